"""The MLA latent cache (DeepSeek-V2/V3): per layer and token, the normed KV latent c (kv_lora_rank) and the
RoPE key k_rope (qk_rope_dim) that every head shares, stored as one row [c, k_rope] of args.latent_dim numbers.

model.MLAttention attends in the absorbed form: each head's query is [q_nope·W_UK, q_rope] (width latent_dim),
scores are q·row, and the output is P·c (the first kv_lora_rank channels of the rows), which the attention
module projects by W_UV. So the cache is multi-query attention with one shared "head" whose values are a
prefix of its keys: `attend(layer, q [B, H, T, r + rope], kv [B, 1, T, r + rope], None, start_pos)` ->
[B, H, T, r]. Shape legend: B batch, H query heads, T new tokens, S cached tokens, r kv_lora_rank.

Modes (moec/runtime/kvcache.py): dynamic (host lengths), static (device positions, graph-safe, the engine
of runtime/decode.py) and simulated (one teacher-forced forward per window, start_pos 0). This class keeps the
rows in `dtype` (fp16 unless told): the baseline a compressed latent codec is measured against.
"""

from __future__ import annotations

import torch

from .backend import kernels_enabled
from .config import ModelArgs
from .kvcache import MODES


def latent_attention(q: torch.Tensor, rows: torch.Tensor, r: int, scale: float, start_pos: int) -> torch.Tensor:
    """Causal absorbed attention: q [B, H, T, r + rope] at positions start_pos.., rows [B, S, r + rope] with
    S = start_pos + T -> P·rows[..., :r] [B, H, T, r] (scores and softmax in fp32)."""
    B, H, T, _ = q.shape
    S = rows.shape[1]
    s = torch.matmul(q.float(), rows.float().transpose(1, 2)[:, None]) * scale  # [B, H, T, S]
    if T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, rows[..., :r].float()[:, None]).to(q.dtype)


class MLACache:
    """Latent rows [B, max_len, latent_dim] per layer in `dtype`, in any mode (module docstring)."""

    codec = "fp16"

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float16, device="cpu",
                 mode: str = "dynamic"):
        assert mode in MODES, mode
        assert args.is_mla, "MLACache holds MLA latents"
        from .model import mla_softmax_scale

        self.args, self.batch, self.max_len, self.device, self.mode = args, batch, max_len, torch.device(device), mode
        self.scale = mla_softmax_scale(args)
        self.rows = [torch.zeros(batch, max_len, args.latent_dim, dtype=dtype, device=device)
                     for _ in range(args.n_layers)]
        if mode == "static":
            self.slots = torch.arange(max_len, device=device)
            self.row_ids = torch.arange(batch, device=device)
            self.pos: torch.Tensor | None = None  # [B] int64, the engine's position buffer
            self.length: int | list[int] = [0] * batch
        else:
            self.length = 0

    @staticmethod
    def bytes_per_token(args: ModelArgs) -> int:
        return args.n_layers * args.latent_dim * 2

    def attend(self, layer: int, q, kv, v=None, start_pos=None) -> torch.Tensor:
        r = self.args.kv_lora_rank
        if self.mode == "static":
            return self._step(layer, q, kv)
        if self.mode == "simulated":
            assert start_pos == 0, "simulated decode runs one forward per window"
        end = start_pos + kv.shape[2]
        assert end <= self.max_len, (end, self.max_len)
        self.rows[layer][:, start_pos:end] = kv[:, 0]
        if layer == self.args.n_layers - 1:
            self.length = end
        return latent_attention(q, self.rows[layer][:, :end].to(q.dtype), r, self.scale, start_pos)

    # -- static mode: the step (graph-safe) and the engine's bookkeeping ---------------------------------

    def _step(self, layer: int, q, kv) -> torch.Tensor:
        """Decode step: q [b, H, 1, r + rope]; kv [b, 1, 1, r + rope] at positions pos[:b] -> [b, H, 1, r]."""
        b = q.shape[0]
        pos = self.pos[:b]
        rows = self.rows[layer]
        r = self.args.kv_lora_rank
        if kernels_enabled(q.device) and r % 16 == 0:
            # one kernel: the new row's write and flash-decoding over slots <= pos (kernels/mla_decode_attention.py)
            from ..kernels.mla_decode_attention import mla_decode_attention

            out = mla_decode_attention(q[:, :, 0], rows, kv[:, 0, 0], pos, r, self.scale)
            return out[:, :, None]
        rows[self.row_ids[:b], pos] = kv[:, 0, 0].to(rows.dtype)
        dt = rows.dtype if q.is_cuda else q.dtype  # the query's dtype on the CPU (the fp32 reference)
        s = torch.matmul(q[:, :, 0].to(dt), rows[:b].to(dt).transpose(1, 2)).float() * self.scale  # [b, H, S]
        s = s.masked_fill((self.slots[None, :] > pos[:, None])[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out = torch.matmul(p.to(dt), rows[:b, :, : self.args.kv_lora_rank].to(dt))  # [b, H, r]
        return out[:, :, None].to(q.dtype)

    def prefill_row(self, row: int, layer: int, kv: torch.Tensor, v=None) -> None:
        """kv [1, T, r + rope] of positions 0..T-1 (the 'kv_latent' observer event of one row)."""
        T = kv.shape[1]
        self.rows[layer][row, :T] = kv[0]

    def after_step(self, rows: range) -> None:
        for r in rows:
            self.length[r] += 1

    def set_length(self, row: int, n: int) -> None:
        self.length[row] = n

    def bytes_read(self, rows: range) -> int:
        """Latent bytes a decode step reads for `rows` (the tokens held, as stored)."""
        return sum(self.length[r] + 1 for r in rows) * self.args.n_layers * self.args.latent_dim \
            * self.rows[0].element_size()

    def fill_random(self, row: int, n: int, gen: torch.Generator | None = None) -> None:
        """Stand-in history of n tokens (latency runs; values are irrelevant to the timing)."""
        for t in self.rows:
            t[row, :n].normal_(0, 1, generator=gen)
        self.length[row] = n

    # -- bytes (dynamic, simulated): the latent KV bits, 8 · bytes / (tokens · layers · latent_dim) --

    def stored_bytes(self) -> int:
        return self.length * self.batch * self.args.n_layers * self.args.latent_dim * self.rows[0].element_size()

    def bits_per_element(self) -> float:
        elems = self.length * self.batch * self.args.n_layers * self.args.latent_dim
        return 8.0 * self.stored_bytes() / max(elems, 1)

    def bits_at(self, tokens: int) -> float:
        return 8.0 * self.rows[0].element_size()
