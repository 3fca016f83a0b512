"""mla-nuq: the MLA latent cache (DeepSeek-V2/V3, runtime/mla.py) compressed to 2 bits per number.

What is stored, per layer and token, for the row x = [c (r = kv_lora_rank), k_rope (rp = qk_rope_dim)]:
  - the row rotated: y = [c·Rc, k_rope·Rr], Rc and Rr randomized Hadamards (moec/rotation.py; their ±1 signs
    [n / b, b] are tensors of the checkpoint, so the basis travels with the levels fitted in it). Rotation spreads the
    latent's few large channels (and RoPE's low-frequency pairs) over all channels of the part, so one scale
    per token and part fits every channel;
  - sinks (the first `sinks` tokens) and the window (the most recent `window`..`window + block - 1` tokens) as
    fp16 rows of y (kvtiered.TierPolicy: the tier rule every tiered cache follows);
  - the history: per token and part (c, k_rope) one fp16 scale s = rms of the part and 2-bit codes, the value
    of a number being s · levels[part][code]. The 4 levels per layer and part are fitted on calibration
    latents normalized by their rms (calibrate/mla_nuq.py), or a unit Gaussian's Lloyd-Max levels.
Codes are packed in planes: a part of n channels takes n / 4 bytes, byte j holding channels j, j + n/4,
j + n/2, j + 3n/4 in bits 0-1, 2-3, 4-5, 6-7 (a kernel unpacks a whole tile with one shift per plane and no
gather). A history row is r/4 + rp/4 bytes of codes + 2 fp16 scales: 148 bytes for DeepSeek's 512 + 64,
against 1152 in fp16 (2.06 bits per number; 2.12 at 32k with kv-mla-nuq2's fp16 sinks and window).

Attention runs in the rotated basis: (q·R)·(x·R) = q·x. The cache exposes Rc (`latent_rotation`), and
model.MLAttention folds it into its absorbed weights (W_UK·Rc, W_UV·Rc: made once), so the query's latent part
arrives rotated and the output P·(c·Rc) leaves rotated at no cost per step; the cache rotates the query's RoPE
part by Rr (in the decode kernel on CUDA) and each new row by blockdiag(Rc, Rr).

Encoding is per token (its scale and codes depend on its own row only), so every mode stores the same bytes
for the same rows, whenever a token leaves the window:
    dynamic    `view[layer]` [B, max_len, L] fp32 is what the attention reads (fp16 values of sinks and window,
               dequantized history); blocks are encoded after each attend (prefill sees its own fp16 rows)
    static     the CUDA-graph engine: a compact fp16 window [B, sinks + window + block, L] per layer (new token at
               slot pos − hist_len, shifted down a block when one ages, host-side in after_step) and the codes
               [B, history, bytes]; on CUDA the decode kernel (kernels/mla_nuq_decode_attention.py) reads both
    simulated  one teacher-forced forward per window giving each query the view dynamic decode gives it
Bytes (the issue's KV bits): 8 · stored bytes / (tokens · layers · (r + rp)), the window at 16 bits.
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from ..formats.kvsection import layer_tensor
from ..rotation import rotate, signs_error
from .backend import kernels_enabled
from .config import ModelArgs
from .kvcache import MODES
from .kvtiered import TierPolicy, WindowSlots

BITS = 2
PLANES = 8 // BITS
LEVELS = 1 << BITS
# Lloyd-Max levels of a unit Gaussian (4 levels): the `levels: gaussian` setting and the random stand-in
GAUSSIAN_LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)
PARTS = ("c_signs", "rope_signs", "c_levels", "rope_levels")
SIGN_SEED = {"c": 0, "rope": 1 << 16}  # randomized signs of layer i: seed SIGN_SEED[part] + i (calibrate/mla_nuq)


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """Dense R [n, n] fp32 of moec.rotation.rotate with int8 ±1 `signs` [n / b, b]: x @ R = rotate(x, signs)."""
    n = signs.numel()
    return rotate(torch.eye(n, dtype=torch.float32), signs.to(torch.float32))


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., n] (values < 4, n % 4 == 0) -> uint8 [..., n / 4] in the plane layout (module docstring)."""
    n = codes.shape[-1]
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], PLANES, n // PLANES)
    out = c[..., 0, :].clone()
    for k in range(1, PLANES):
        out |= c[..., k, :] << (BITS * k)
    return out


def unpack_planes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 4] -> int64 codes [..., n] (inverse of pack_planes)."""
    shifts = torch.arange(PLANES, device=packed.device, dtype=torch.uint8) * BITS
    c = (packed[..., None, :] >> shifts[:, None]) & (LEVELS - 1)  # [..., 4, n / 4]
    return c.reshape(*packed.shape[:-1], -1).long()


class LatentRowCodec:
    """One layer's codec: rotations, levels and the per-token encode/decode of rows y (already rotated)."""

    def __init__(self, r: int, rp: int, c_signs: torch.Tensor, rope_signs: torch.Tensor, c_levels: torch.Tensor,
                 rope_levels: torch.Tensor):
        assert r % (PLANES * 4) == 0 and rp % (PLANES * 4) == 0, (r, rp)  # whole 16-wide planes (kernel dots)
        self.r, self.rp, self.L = r, rp, r + rp
        self.nbytes = (r + rp) // PLANES  # code bytes per row
        self.signs = {"c": c_signs.to(torch.int8), "rope": rope_signs.to(torch.int8)}
        Rc, Rr = rotation_matrix(self.signs["c"]), rotation_matrix(self.signs["rope"])
        self.R = torch.block_diag(Rc, Rr).contiguous()  # [L, L] fp32: rows
        self.Rc, self.Rr = Rc.contiguous(), Rr.contiguous()  # the model folds Rc in; the cache applies Rr to q_rope
        self.levels = torch.stack([c_levels.float().reshape(LEVELS), rope_levels.float().reshape(LEVELS)])  # [2, 4]
        self._mid = (self.levels[:, 1:] + self.levels[:, :-1]) / 2  # decision thresholds [2, 3]

    def to(self, device) -> LatentRowCodec:
        out = object.__new__(LatentRowCodec)
        out.__dict__.update(self.__dict__)
        out.R, out.Rc, out.Rr, out.levels, out._mid = (t.to(device) for t in (self.R, self.Rc, self.Rr, self.levels,
                                                                             self._mid))
        return out

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., L] into the stored basis (fp32 product, in x's dtype)."""
        return (x.float() @ self.R.to(x.device)).to(x.dtype)

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., L] whose latent part is rotated already (the model folds Rc in) -> the RoPE part rotated too."""
        r = self.r
        return torch.cat([q[..., :r], (q[..., r:].float() @ self.Rr.to(q.device)).to(q.dtype)], -1)

    def encode(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated rows y [..., L] (fp16 values) -> (codes uint8 [..., L / 4], scales fp16 [..., 2])."""
        y = y.float()
        codes, scales = [], []
        for i, part in enumerate((y[..., : self.r], y[..., self.r :])):
            s = part.pow(2).mean(-1, keepdim=True).sqrt().half()
            s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero part: any scale decodes it to 0·level
            u = part / s.float()
            codes.append(pack_planes(torch.bucketize(u, self._mid[i].to(u.device))))  # planes per part
            scales.append(s)
        return torch.cat(codes, -1), torch.cat(scales, -1)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(codes [..., L / 4], scales [..., 2]) -> rows [..., L] fp32 in the rotated basis."""
        nc = self.r // PLANES
        lev = self.levels.to(codes.device)
        c = lev[0][unpack_planes(codes[..., :nc])] * scales[..., :1].float()
        kr = lev[1][unpack_planes(codes[..., nc:])] * scales[..., 1:].float()
        return torch.cat([c, kr], -1)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {"c_levels": self.levels[0], "rope_levels": self.levels[1],
                "c_signs": self.signs["c"], "rope_signs": self.signs["rope"]}


class MLANUQCache(WindowSlots):
    """The compressed latent cache in any mode (module docstring). `codecs`: one LatentRowCodec per layer."""

    codec = "mla-nuq"

    def __init__(self, args: ModelArgs, batch: int, max_len: int, codecs: list[LatentRowCodec], window: int = 128,
                 sinks: int = 4, block: int = 32, device="cpu", mode: str = "dynamic", use_kernel: bool | None = None):
        assert mode in MODES, mode
        assert args.is_mla and len(codecs) == args.n_layers, (args.is_mla, len(codecs))
        from .model import mla_softmax_scale

        self.args, self.batch, self.max_len, self.mode = args, batch, max_len, mode
        self.device = torch.device(device)
        self.codecs = [c.to(self.device) for c in codecs]
        self.policy = TierPolicy(sinks, window, block)
        self.sinks, self.window, self.block = sinks, window, block
        self.scale = mla_softmax_scale(args)
        self.r, self.L = args.kv_lora_rank, args.latent_dim
        nb, L = self.codecs[0].nbytes, self.L
        cap = self.policy.capacity(max_len) * block  # history tokens a row can come to hold
        self.codes = [torch.zeros(batch, cap, nb, dtype=torch.uint8, device=device) for _ in codecs]
        self.scales = [torch.zeros(batch, cap, 2, dtype=torch.float16, device=device) for _ in codecs]
        if mode != "static":
            self.view = [torch.zeros(batch, max_len, L, dtype=torch.float32, device=device) for _ in codecs]
            self.n_blocks = [0] * args.n_layers
            self.length: int | list[int] = 0
            return
        self.wcap = self.policy.window_slots()
        self.win = [torch.zeros(batch, self.wcap, L, dtype=torch.float16, device=device) for _ in codecs]
        self.hist_len = torch.zeros(batch, dtype=torch.int32, device=device)
        self.n_blocks = [0] * batch
        self.length = [0] * batch
        self.rows = torch.arange(batch, device=device)
        self.wslots = torch.arange(self.wcap, device=device)
        self.hslots = torch.arange(cap, device=device)
        self.pos: torch.Tensor | None = None  # [B] int64, the engine's position buffer
        if use_kernel is None:
            from ..kernels.mla_nuq_decode_attention import supports

            use_kernel = kernels_enabled(self.device) and supports(self.r, args.qk_rope_dim)
        self.use_kernel = use_kernel
        self._R: dict = {}  # (layer, dtype) -> R in the compute dtype (made outside any capture: begin_step)

    def latent_rotation(self, layer: int) -> torch.Tensor:
        """Rc [r, r] fp32 of `layer`: model.MLAttention queries with q_lat·Rc and reads the output as P·(c·Rc)."""
        return self.codecs[layer].Rc

    # -- dynamic and simulated -------------------------------------------------------------------------------

    def attend(self, layer: int, q, kv, v=None, start_pos=None) -> torch.Tensor:
        """q [B, H, T, L] absorbed queries with the latent part rotated (q_lat·Rc), kv [B, 1, T, L] rows at positions
        start_pos.. -> P·(c·Rc) [B, H, T, r] (latent_rotation)."""
        if self.mode == "static":
            return self._step(layer, q, kv)
        codec = self.codecs[layer]
        y = codec.rotate(kv[:, 0].float()).half().float()  # [B, T, L]: the fp16 rows a window holds
        qr = codec.rotate_query(q.float())
        T = y.shape[1]
        if self.mode == "simulated":
            assert start_pos == 0, "simulated decode runs one forward per window"
            out = self._attend_simulated(layer, qr, y)
        else:
            end = start_pos + T
            assert end <= self.max_len, (end, self.max_len)
            view = self.view[layer]
            view[:, start_pos:end] = y
            s = torch.matmul(qr, view[:, :end].transpose(1, 2)[:, None]) * self.scale  # [B, H, T, end]
            if T > 1:
                mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=end - T)
                s = s.masked_fill(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(s, -1), view[:, :end, : self.r][:, None])
            self._age_view(layer, end)
            if layer == self.args.n_layers - 1:
                self.length = end
        return out.to(q.dtype)

    def _age_view(self, layer: int, tokens: int) -> None:
        """Encode the blocks TierPolicy puts in the history after `tokens` tokens (dynamic: every row at once);
        the view's rows of them become their decoded values."""
        nb, want = self.n_blocks[layer], self.policy.blocks_at(tokens)
        if want > nb:
            h0, h1 = nb * self.block, want * self.block
            p0 = self.sinks + h0
            codec, view = self.codecs[layer], self.view[layer]
            codes, scales = codec.encode(view[:, p0 : p0 + h1 - h0])
            self.codes[layer][:, h0:h1], self.scales[layer][:, h0:h1] = codes, scales
            view[:, p0 : p0 + h1 - h0] = codec.decode(codes, scales)
            self.n_blocks[layer] = want

    def _attend_simulated(self, layer: int, qr: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Query i attends to rows 0..i as dynamic decode holds them at its step (the history aged after i tokens,
        its own row appended): decoded for positions sinks .. sinks + blocks_at(i)·block, fp16 otherwise."""
        T = y.shape[1]
        codec = self.codecs[layer]
        codes, scales = codec.encode(y)
        deq = codec.decode(codes, scales)
        i = torch.arange(T, device=y.device)[:, None]
        j = torch.arange(T, device=y.device)[None, :]
        hist_end = torch.tensor([self.sinks + self.policy.blocks_at(t) * self.block for t in range(T)],
                                device=y.device)[:, None]
        causal = j <= i
        in_hist = causal & (j >= self.sinks) & (j < hist_end)
        s_fp = torch.matmul(qr, y.transpose(1, 2)[:, None])
        s_q = torch.matmul(qr, deq.transpose(1, 2)[:, None])
        s = (torch.where(in_hist, s_q, s_fp) * self.scale).masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, -1)
        out = torch.matmul(torch.where(in_hist, 0.0, p), y[..., : self.r][:, None]) + \
            torch.matmul(torch.where(in_hist, p, 0.0), deq[..., : self.r][:, None])
        nb = self.policy.blocks_at(T)  # what dynamic decode holds at the end
        h1 = nb * self.block
        self.codes[layer][:, :h1] = codes[:, self.sinks : self.sinks + h1]
        self.scales[layer][:, :h1] = scales[:, self.sinks : self.sinks + h1]
        self.n_blocks[layer] = nb
        if layer == self.args.n_layers - 1:
            self.length = T
        return out

    # -- static mode: the step (graph-safe) ------------------------------------------------------------------

    def _rot(self, layer: int, dtype) -> torch.Tensor:
        key = (layer, dtype)
        if key not in self._R:
            self._R[key] = self.codecs[layer].R.to(dtype)
        return self._R[key]

    def _step(self, layer: int, q, kv) -> torch.Tensor:
        """q [b, H, 1, L] (latent part rotated); kv [b, 1, 1, L] at positions pos[:b] -> [b, H, 1, r] rotated."""
        b = q.shape[0]
        codec = self.codecs[layer]
        slot, win_len = self._slots(b)
        new = torch.matmul(kv[:, 0, 0].to(q.dtype), self._rot(layer, q.dtype))  # [b, L]: the row as stored
        win = self.win[layer]
        if self.use_kernel:
            from ..kernels.mla_nuq_decode_attention import mla_nuq_decode_attention

            out = mla_nuq_decode_attention(q[:, :, 0], self.codes[layer], self.scales[layer], codec.levels,
                                           self.hist_len[:b], win, new, win_len, self.r, self.scale,
                                           rope_rotation=codec.Rr, out_dtype=q.dtype)
            return out[:, :, None]
        qr = codec.rotate_query(q[:, :, 0])
        win[self.rows[:b], slot] = new.half()
        keys = torch.cat([win[:b].float(), codec.decode(self.codes[layer][:b], self.scales[layer][:b])], 1)
        mask = torch.cat([self.wslots[None, :] < win_len[:, None],
                          self.hslots[None, :] < self.hist_len[:b, None]], 1)  # [b, wcap + cap]
        s = torch.matmul(qr.float(), keys.transpose(1, 2)) * self.scale  # [b, H, S]
        p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1)
        out = torch.matmul(p, keys[..., : self.r])
        return out[:, :, None].to(q.dtype)

    # -- static mode: host-side bookkeeping between steps ----------------------------------------------------

    def _age_row(self, row: int) -> None:
        """Move whole window blocks of `row` into the history (every layer) until TierPolicy holds."""
        s, blk = self.sinks, self.block
        nb = self.n_blocks[row]
        while nb < self.policy.blocks_at(self.length[row]):
            held = self.length[row] - nb * blk
            for layer, codec in enumerate(self.codecs):
                w = self.win[layer]
                codes, scales = codec.encode(w[row, s : s + blk])
                self.codes[layer][row, nb * blk : (nb + 1) * blk] = codes
                self.scales[layer][row, nb * blk : (nb + 1) * blk] = scales
                w[row, s : held - blk] = w[row, s + blk : held].clone()
            nb += 1
            self.n_blocks[row] = nb
            self.hist_len[row] = nb * blk

    def after_step(self, rows: range) -> None:
        for r in rows:
            self.length[r] += 1
            self._age_row(r)

    def prefill_row(self, row: int, layer: int, kv: torch.Tensor, v=None) -> None:
        """kv [1, T, L] of positions 0..T-1 (the 'kv_latent' event) into an empty row: sinks and the newest
        tokens into the window, the blocks the history holds after T tokens encoded."""
        assert self.length[row] == 0, "prefill_row needs an empty row"
        codec = self.codecs[layer]
        y = codec.rotate(kv[0].float()).half()  # [T, L]
        T = y.shape[0]
        s, nb = min(self.sinks, T), self.policy.blocks_at(T)
        h = nb * self.block
        w = self.win[layer]
        w[row, :s] = y[:s]
        if h:
            codes, scales = codec.encode(y[s : s + h])
            self.codes[layer][row, :h], self.scales[layer][row, :h] = codes, scales
        rest = y[s + h :]
        w[row, s : s + rest.shape[0]] = rest

    def set_length(self, row: int, n: int) -> None:
        nb = self.policy.blocks_at(n)
        self.length[row], self.n_blocks[row] = n, nb
        self.hist_len[row] = nb * self.block

    def history_bytes_per_token(self) -> int:
        """Stored bytes of one history token over all layers: codes + 2 fp16 scales per layer."""
        return self.args.n_layers * (self.codecs[0].nbytes + 4)

    def bytes_read(self, rows: range) -> int:
        """Bytes a decode step reads for `rows`: the history as stored, the fp16 window (with the new row)."""
        n = 0
        for r in rows:
            h = self.n_blocks[r] * self.block
            n += h * self.history_bytes_per_token() + (self.length[r] + 1 - h) * self.args.n_layers * self.L * 2
        return n

    def fill_random(self, row: int, n: int, gen: torch.Generator | None = None) -> None:
        """Stand-in history of n tokens (latency runs): random codes, unit scales, a random fp16 window."""
        nb = self.policy.blocks_at(n)
        h = nb * self.block
        for layer in range(self.args.n_layers):
            self.codes[layer][row, :h] = torch.randint(0, 256, (h, self.codecs[0].nbytes), generator=gen,
                                                       device=self.device, dtype=torch.uint8)
            self.scales[layer][row, :h] = 1.0
            self.win[layer][row, : n - h].normal_(0, 1, generator=gen)
        self.length[row], self.n_blocks[row] = n, nb
        self.hist_len[row] = h

    # -- bytes (dynamic, simulated): the latent KV bits -------------------------------------------------------

    def _bytes_at(self, tokens: int) -> int:
        """Stored bytes of one row after `tokens` tokens, all layers, plus the codecs' static tensors."""
        h = self.policy.blocks_at(tokens) * self.block
        return h * self.history_bytes_per_token() + (tokens - h) * self.args.n_layers * self.L * 2

    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.codecs for t in c.static_tensors().values())

    def stored_bytes(self) -> int:
        return self.batch * self._bytes_at(self.length) + self.static_bytes()

    def bits_per_element(self) -> float:
        elems = self.length * self.batch * self.args.n_layers * self.L
        return 8.0 * self.stored_bytes() / max(elems, 1)

    def bits_at(self, tokens: int) -> float:
        """KV bits per latent number of one row at `tokens` tokens (static tensors left out: per model)."""
        return 8.0 * self._bytes_at(tokens) / (tokens * self.args.n_layers * self.L)


# -- registry hooks (moec/registry.py) ----------------------------------------------------------------------

def tensor_names(section: dict, args) -> list[str]:
    return [layer_tensor(i, p) for i in range(args.n_layers) for p in PARTS]


def build_codecs(section: dict, tensors: dict[str, torch.Tensor], args) -> list[LatentRowCodec]:
    """One LatentRowCodec per layer from the kv.* tensors; FormatError naming a missing or malformed tensor."""
    if not args.is_mla:
        raise FormatError(f"KV codec mla-nuq holds MLA latents, but the model ({args.arch}) has no MLA attention")
    r, rp = args.kv_lora_rank, args.qk_rope_dim
    codecs = []
    for i in range(args.n_layers):
        got = {}
        for part in PARTS:
            name = layer_tensor(i, part)
            t = tensors.get(name)
            if t is None:
                raise FormatError(f"KV calibration tensor {name} is missing")
            got[part] = t.cpu()
        signs = {}
        for part, n in (("c", r), ("rope", rp)):
            t = got[f"{part}_signs"]  # ±1 [n / b, b] (kv-calib tensors are fp32)
            err = "entries other than ±1" if not bool(((t == 1) | (t == -1)).all()) else \
                signs_error(t.to(torch.int8), n)
            if err is not None:
                raise FormatError(f"KV calibration tensor {layer_tensor(i, part + '_signs')}: {err}")
            signs[part] = t.to(torch.int8)
        for part in ("c_levels", "rope_levels"):
            lv = got[part]
            if lv.numel() != LEVELS or not bool(torch.isfinite(lv).all()) or not bool((lv.diff() > 0).all()):
                raise FormatError(f"KV calibration tensor {layer_tensor(i, part)} must be {LEVELS} increasing "
                                  f"finite levels, got {lv.flatten().tolist()}")
        codecs.append(LatentRowCodec(r, rp, signs["c"], signs["rope"], got["c_levels"], got["rope_levels"]))
    extra = sorted(set(tensors) - set(tensor_names(section, args)))
    if extra:
        raise FormatError(f"KV calibration tensor {extra[0]} does not belong to a {args.n_layers}-layer model")
    return codecs


def cache_factory(section: dict, tensors: dict[str, torch.Tensor], args, mode: str = "dynamic",
                  use_kernel: bool | None = None):
    """(model, batch, max_len) -> MLANUQCache in `mode` (the registry's `cache_factory` hook)."""
    codecs = build_codecs(section, tensors, args)

    def make(model, batch: int, max_len: int):
        dev = model.tok_embeddings.weight.device
        return MLANUQCache(model.args, batch, max_len, codecs, window=section["window"], sinks=section["sinks"],
                           block=section["block"], device=dev, mode=mode, use_kernel=use_kernel)

    return make


def signs_for(n: int, seed: int) -> torch.Tensor:
    """int8 ±1 [1, n]: one randomized Hadamard over the whole part (n a power of two) or over its largest
    power-of-two blocks."""
    from ..rotation import hadamard_signs, pow2_block

    return hadamard_signs(n, pow2_block(n), seed)


def random_tensors(args, section: dict, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Stand-in calibration (latency runs): the Gaussian levels and the seeded signs calibration would use."""
    out = {}
    lev = torch.tensor(GAUSSIAN_LEVELS)
    for i in range(args.n_layers):
        out[layer_tensor(i, "c_signs")] = signs_for(args.kv_lora_rank, SIGN_SEED["c"] + i).float()
        out[layer_tensor(i, "rope_signs")] = signs_for(args.qk_rope_dim, SIGN_SEED["rope"] + i).float()
        out[layer_tensor(i, "c_levels")] = lev.clone()
        out[layer_tensor(i, "rope_levels")] = lev.clone()
    return {n: t.to(device) for n, t in out.items()}

