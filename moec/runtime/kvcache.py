"""KV caches. The model calls `cache.attend(layer, q, k, v, start_pos)`; the cache stores the new
keys/values in its own format and returns the attention output, so a compressed cache attends straight
from its packed history without the model knowing the format.

One class per codec family, each with three modes of the same object (`mode=`):
    dynamic    host-side lengths, every row at the same length: `Transformer.forward` step by step
               (eval --mode dec, generate through loader.kv_cache_factory, the transformers Cache)
    static     device-side positions (`cache.pos`, set by runtime/decode.DecodeEngine), one token per
               row per step, graph-safe (no host reads of device values, nothing allocated in the step):
               the CUDA-graph decode engine; rows are filled by `prefill_row` and advance by `after_step`
    simulated  one teacher-forced forward per window (start_pos 0) that gives each query the keys/values
               the dynamic mode would hold at its step (benchmarks/bench_kv_quality.py)
The families:
    FP16Cache           (here) the uncompressed cache, the baseline every codec is compared against
    MLACache            (mla.py) the uncompressed MLA latent (DeepSeek): one shared row per token and layer;
                        `dense_cache` picks it for an MLA model
    TieredKVCache       (kvtiered.py) fp16 sinks + window, block-encoded history: every registered block
                        codec (nuq-outlier, kivi, any `layer_codecs` hook of moec/registry.py)
    LatentKVCache       (latent.py) the tiered layout with layer groups encoded into PCA latents
    RVQTieredCache      (rvq.py) the tiered layout with a middle and an archive residual-VQ tier
    MLANUQCache         (mla_nuq.py) the MLA latent compressed (KV codec mla-nuq): rotated rows, 2-bit per-token
                        codes in the history, fp16 sinks + window by TierPolicy
    LayerSplitCache     (here) a model with sliding-window layers (gpt-oss) under a tiered block codec: the window
                        layers in an FP16Cache of rings, the full-attention layers in the codec's cache
The tier rule (which tokens are sinks, history blocks or window) is kvtiered.TierPolicy and the ageing of
the window into the history is the one function kvtiered.TieredKVCache._age, used by every mode of every
tiered family.

Adding a family: one class. Subclass TieredKVCache when the family keeps the
fp16 sinks + window and encodes blocks leaving it: override `_make_store` (its history buffers, as
latent._LatentStore), `_layer_groups` (layers encoded together), `_encode_group` (encode n blocks of a
group of layers), `_aged` (work after ageing, such as the RVQ archive), and the attention of the modes it
supports (`_attend` for dynamic, `_step_torch` / `_step_kernel` for static, `_attend_simulated`); set
`position_order_view = False` if its queries do not all attend over one view in position order (moec/hf then
refuses it). The windows and their ageing (`_age`) come with the base class, in every mode. A family with
another layout writes a class with `attend`, `stored_bytes` / `bits_per_element` and, for the static engine,
`prefill_row`, `set_length`, `after_step`, `bytes_read`, `fill_random`, as FP16Cache does. Then register its
builder as the codec's `cache_factory(section, tensors, args, mode="dynamic") -> make(model, batch, max_len)`
hook (moec/registry.py; decode.static_cache_factory asks it for mode="static"), and add it to
tests/runtime/test_cache_modes.py (its modes must store byte-identical history).
"""

from __future__ import annotations

import torch

from .backend import kernels_enabled
from .config import ModelArgs
from .model import sdpa, windowed_attention

MODES = ("dynamic", "static", "simulated")
SPLIT = 128  # tokens per chunk of the split-K decode attention over the static fp16 cache


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                     scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, T, d] at positions start_pos..start_pos+T-1; k, v: [B, K, S, d] with S = start_pos+T.
    scale: the score scale (SDPA's default 1/√(q's last dim) when None); sinks [H]: `sdpa`'s."""
    T, S = q.shape[2], k.shape[2]
    mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    return sdpa(q, k, v, mask, scale, None if sinks is None else sinks.view(-1, 1))


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Decode attention over a static cache, split along the cache (flash-decoding in plain torch):
    q [b, K, G, d]; k, v [b, K, S, d] (S a multiple of SPLIT); keys at slots <= pos[b] -> [b, K, G, d].

    SDPA on one query token with a length mask runs one program per (row, KV head), far too few to
    stream a long cache at bandwidth; here the cache is viewed as n = S / SPLIT chunks, scores and
    p·V are batched matmuls over (row, head, chunk), and the softmax runs over the whole row."""
    b, K, S, d = k.shape
    n = S // SPLIT
    kc = k.view(b, K, n, SPLIT, d)
    vc = v.view(b, K, n, SPLIT, d)
    s = torch.matmul(q[:, :, None], kc.transpose(-1, -2)).float() * d**-0.5  # [b, K, n, G, SPLIT]
    slots = torch.arange(S, device=k.device).view(1, 1, n, 1, SPLIT)
    s = s.masked_fill(slots > pos.view(b, 1, 1, 1, 1), float("-inf"))
    m = s.amax(dim=(2, 4), keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(dim=(2, 4))  # [b, K, G]
    out = torch.matmul(p.to(v.dtype), vc).float().sum(2)  # [b, K, G, d]
    return out / den[..., None]


def dense_cache(args: ModelArgs, batch: int, max_len: int, dtype=torch.float16, device="cpu", mode: str = "dynamic"):
    """The uncompressed cache of `args`' attention: FP16Cache, or mla.MLACache for multi-head latent attention."""
    if args.is_mla:
        from .mla import MLACache

        return MLACache(args, batch, max_len, dtype=dtype, device=device, mode=mode)
    return FP16Cache(args, batch, max_len, dtype=dtype, device=device, mode=mode)


class FP16Cache:
    """Keys/values as stored tensors [B, K, max_len, d] per layer, in `dtype` (fp16 unless told), in any mode
    (module docstring). `length`: tokens held, an int (dynamic, simulated) or a host list per row (static)."""

    codec = "fp16"

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float16, device="cpu",
                 mode: str = "dynamic"):
        assert mode in MODES, mode
        self.args, self.batch, self.max_len, self.device, self.mode = args, batch, max_len, torch.device(device), mode
        # a sliding-window layer holds its last `window` tokens in a ring (slot = position % window): the
        # tokens it can still attend to, whatever the context; a full layer every position
        self.cap = [min(w, max_len) if w else max_len for w in args.layer_windows]
        shapes = [(batch, args.n_kv_heads, c, args.head_dim) for c in self.cap]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        if mode == "static":
            self.slots = torch.arange(max(self.cap), device=device)  # a ring's slots: a window-only cache stays fixed
            self.rows = torch.arange(batch, device=device)
            self.pos: torch.Tensor | None = None  # [B] int64, the engine's position buffer
            self.length: int | list[int] = [0] * batch  # host mirror of tokens held per row
        else:
            self.length = 0

    @staticmethod
    def bytes_per_token(args: ModelArgs) -> int:
        return 2 * args.n_layers * args.n_kv_heads * args.head_dim * 2

    def held_tokens(self, n: int) -> int:
        """Token-layers held once a row has n tokens: n per full layer, at most its window per window layer."""
        return sum(min(n, c) for c in self.cap)

    def attend(self, layer: int, q, k, v, start_pos=None, sinks=None) -> torch.Tensor:
        """sinks [H]: gpt-oss's per-head logits in the softmax's denominator (model.windowed_attention)."""
        if self.mode == "static":
            return self._step(layer, q, k, v, sinks)
        if self.mode == "simulated":
            assert start_pos == 0, "simulated decode runs one forward per window"
        end = start_pos + k.shape[2]
        assert end <= self.max_len, (end, self.max_len)
        if layer == self.args.n_layers - 1:
            self.length = end
        window = self.args.layer_windows[layer]
        if window:
            return self._attend_ring(layer, q, k, v, start_pos, window, sinks)
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        keys = self.k[layer][:, :, :end].to(q.dtype)
        values = self.v[layer][:, :, :end].to(q.dtype)
        return causal_attention(q, keys, values, start_pos, sinks=sinks)

    def _attend_ring(self, layer: int, q, k, v, start_pos: int, window: int, sinks) -> torch.Tensor:
        """A window layer (dynamic, simulated): the ring's tokens (those before start_pos it still holds, in
        position order) and the new ones attended under the window mask, then the new ones written."""
        cap, T = self.cap[layer], k.shape[2]
        held = torch.arange(max(0, start_pos - cap), start_pos, device=q.device)
        pos = torch.cat([held, torch.arange(start_pos, start_pos + T, device=q.device)])
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)  # attend to what the ring holds, as stored
        keys = torch.cat([self.k[layer][:, :, held % cap], k], 2).to(q.dtype)
        values = torch.cat([self.v[layer][:, :, held % cap], v], 2).to(q.dtype)
        out = windowed_attention(q, keys, values, pos, window, sinks)
        kept = pos[-min(T, cap):]  # the newest tokens the ring keeps
        self.k[layer][:, :, kept % cap] = k[:, :, -kept.numel():]
        self.v[layer][:, :, kept % cap] = v[:, :, -kept.numel():]
        return out

    # -- static mode: the step (graph-safe) and the engine's bookkeeping ---------------------------------

    def _step(self, layer: int, q, k, v, sinks=None) -> torch.Tensor:
        """Decode step: q [b, H, 1, d]; k, v [b, K, 1, d] at positions pos[:b] -> [b, H, 1, d]. A window
        layer writes slot pos % window and attends to every slot it holds (its ring is the window)."""
        b, H, _, d = q.shape
        K = k.shape[1]
        pos = self.pos[:b]
        kc, vc = self.k[layer], self.v[layer]
        ring = self.cap[layer] if self.args.layer_windows[layer] else 0
        if kernels_enabled(q.device) and d & (d - 1) == 0 and d >= 16:
            # one kernel: the new token's write and flash-decoding over slots <= pos
            from ..kernels.fp16_decode_attention import fp16_decode_attention

            return fp16_decode_attention(q[:, :, 0], kc, vc, k[:, :, 0], v[:, :, 0], pos, ring=ring,
                                         sinks=sinks).view(b, H, 1, d)
        slot = pos % ring if ring else pos
        kc[self.rows[:b], :, slot] = k[:, :, 0].to(kc.dtype)
        vc[self.rows[:b], :, slot] = v[:, :, 0].to(vc.dtype)
        if q.is_cuda and self.max_len % SPLIT == 0 and not ring and sinks is None:
            out = split_attention(q.view(b, K, H // K, d).to(kc.dtype), kc[:b], vc[:b], pos)
            return out.reshape(b, H, 1, d).to(q.dtype)
        held = self.slots[: kc.shape[2]]
        mask = (held[None, :] <= pos[:, None])[:, None, None, :]  # [b, 1, 1, S]: a ring past its size holds all
        # the query's dtype on the CPU (the fp32 reference)
        dt = kc.dtype if q.is_cuda else q.dtype
        out = sdpa(q.view(b, K, H // K, d).to(dt), kc[:b].to(dt), vc[:b].to(dt), mask,
                   sinks=None if sinks is None else sinks.view(K, H // K))  # [b, K, G, d]
        return out.reshape(b, H, 1, d).to(q.dtype)

    def prefill_row(self, row: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [K, T, d] of positions 0..T-1 (post-RoPE); a window layer keeps the last of them, in its ring."""
        T, cap = k.shape[1], self.cap[layer]
        kept = torch.arange(max(0, T - cap), T, device=k.device)
        self.k[layer][row, :, kept % cap] = k[:, kept].to(self.k[layer].dtype)
        self.v[layer][row, :, kept % cap] = v[:, kept].to(self.v[layer].dtype)

    def after_step(self, rows: range) -> None:
        for r in rows:
            self.length[r] += 1

    def set_length(self, row: int, n: int) -> None:
        self.length[row] = n

    def bytes_read(self, rows: range) -> int:
        """KV bytes a decode step reads for `rows` (the tokens held, as stored)."""
        per = 2 * self.args.n_kv_heads * self.args.head_dim * self.k[0].element_size()
        return sum(self.held_tokens(self.length[r] + 1) for r in rows) * per

    def fill_random(self, row: int, n: int, gen: torch.Generator | None = None) -> None:
        """Stand-in history of n tokens (latency runs; values are irrelevant to the timing)."""
        for t in (*self.k, *self.v):
            t[row, :, :n].normal_(0, 1, generator=gen)  # a ring: all of it once n passes its size
        self.length[row] = n

    # -- bytes (dynamic, simulated) -------------------------------------------------------------------------

    def stored_bytes(self) -> int:
        """Bytes the cache holds for the tokens written so far (all layers, K and V, whole batch)."""
        per_token = 2 * self.args.n_kv_heads * self.args.head_dim  # per layer
        return self.held_tokens(self.length) * self.k[0].shape[0] * per_token * self.k[0].element_size()

    def bits_per_element(self) -> float:
        elems = self.held_tokens(self.length) * self.k[0].shape[0] * 2 * self.args.n_kv_heads * self.args.head_dim
        return 8.0 * self.stored_bytes() / max(elems, 1)

    def bits_at(self, tokens: int) -> float:
        return 8.0 * self.k[0].element_size()


def layer_subset(args: ModelArgs, layers: list[int]) -> ModelArgs:
    """args for a cache that holds only `layers` of the model (at local indices 0..len(layers)-1)."""
    import dataclasses

    return dataclasses.replace(args, n_layers=len(layers), ffn_kinds=[args.ffn_kinds[i] for i in layers],
                               layer_windows=[args.layer_windows[i] for i in layers])


class LayerSplitCache:
    """A model with sliding-window layers (gpt-oss) served with a compressed cache: the window layers in an
    FP16Cache of their own (each a ring of its window: they never hold more), the full-attention layers in
    `inner` (a cache built for those layers alone, `layer_subset`), where the history outgrows the window and
    the codec pays. Layer i of the model is local index `index[i]` of its part. Same interface as the caches it
    holds, in every mode; the engine's `pos` buffer is shared by both parts."""

    def __init__(self, args: ModelArgs, ring: FP16Cache, inner, windowed: list[int], full: list[int]):
        self.args, self.ring, self.inner, self.parts = args, ring, inner, (ring, inner)
        self.batch, self.max_len, self.mode, self.device = inner.batch, inner.max_len, inner.mode, ring.device
        self.codec = getattr(inner, "codec", None)
        self.route = {i: (ring, j) for j, i in enumerate(windowed)} | {i: (inner, j) for j, i in enumerate(full)}

    @property
    def length(self):
        return self.inner.length

    @property
    def pos(self):
        return self.inner.pos

    @pos.setter
    def pos(self, value) -> None:
        for c in self.parts:
            c.pos = value

    def attend(self, layer: int, q, k, v, start_pos=None, sinks=None) -> torch.Tensor:
        part, j = self.route[layer]  # each part counts its tokens at its own last layer
        return part.attend(j, q, k, v, start_pos, **({} if sinks is None else {"sinks": sinks}))

    def prefill_row(self, row: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        part, j = self.route[layer]
        part.prefill_row(row, j, k, v)

    def begin_step(self, b: int) -> None:
        if hasattr(self.inner, "begin_step"):
            self.inner.begin_step(b)

    def end_step(self) -> None:
        if hasattr(self.inner, "end_step"):
            self.inner.end_step()

    def set_length(self, row: int, n: int) -> None:
        for c in self.parts:
            c.set_length(row, n)

    def after_step(self, rows: range) -> None:
        for c in self.parts:
            c.after_step(rows)

    def bytes_read(self, rows: range) -> int:
        return sum(c.bytes_read(rows) for c in self.parts)

    def fill_random(self, row: int, n: int, gen: torch.Generator | None = None) -> None:
        for c in self.parts:
            c.fill_random(row, n, gen)

    def stored_bytes(self) -> int:
        return sum(c.stored_bytes() for c in self.parts)

    def _elements(self, tokens: int) -> tuple[int, int]:
        """(ring, inner) key and value elements held after `tokens` tokens (the whole batch)."""
        per = 2 * self.args.n_kv_heads * self.args.head_dim * self.batch
        return self.ring.held_tokens(tokens) * per, tokens * self.inner.args.n_layers * per

    def bits_per_element(self) -> float:
        """Bits per held key/value element, both parts together."""
        e = self._elements(self.length)
        return 8.0 * self.stored_bytes() / max(sum(e), 1)

    def bits_at(self, tokens: int) -> float:
        e = self._elements(tokens)
        return (self.ring.bits_at(tokens) * e[0] + self.inner.bits_at(tokens) * e[1]) / max(sum(e), 1)
