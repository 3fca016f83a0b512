"""Layer-sequential capture: run calibration tokens through one decoder layer at a time.

Only one layer's weights and the activations entering it are held at once, so memory is bounded by
samples × seq_len × dim, not by model size. Observers (`observe(layer, name, tensor)`, see
moec/runtime/model.py for the names) accumulate whatever statistics a recipe needs; the fitting
functions then see only those statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.config import ModelArgs
from ..runtime.model import Block, rms_norm, rope_cos_sin

Progress = Callable[[int, int], None]


SCORES_BYTES = 1 << 30  # the attention scores of one capture batch, at most (run_layers)


@torch.no_grad()
def run_layers(args: ModelArgs, global_state: dict, layer_state: Callable[[int], dict], tokens: torch.Tensor,
               observers: list, batch_size: int = 8, dtype=torch.float32, device="cpu",
               progress: Progress | None = None, resume: tuple[int, torch.Tensor] | None = None,
               on_layer_end: Callable[[int, torch.Tensor], None] | None = None,
               offload: bool = False, requantize: Callable[[int], Block | None] | None = None) -> torch.Tensor:
    """Feed tokens [N, L] through every layer; returns the final normed hidden states [N, L, D].

    resume = (start, h): continue an interrupted run (resume.py) at layer `start`, h [N, L, D] the hidden
    states entering it. on_layer_end(i, h) is called once layer i is complete, h entering layer i + 1.
    offload: the hidden states of the whole set stay in host memory and go to `device` one batch at a
    time (4.3 GB fp32 at 128 x 2048 x 4096 that the device then does not hold); the numbers are the same.
    requantize(i): quantized propagation (llm-compressor's sequential pipeline): called once layer i's
    statistics are complete, it fits the layer and returns it with its quantized weights (None: nothing
    quantized there); layer i + 1 then sees that block's outputs instead of the original layer's. It
    costs a copy of the hidden states (the layer's inputs) and a second forward per layer."""
    home = "cpu" if offload else device  # where h lives
    tokens = tokens.to(home)
    start, h = resume if resume is not None else (0, None)
    if h is None:
        h = torch.nn.functional.embedding(tokens, global_state["tok_embeddings.weight"].to(home, dtype))
    else:
        h = h.to(home, dtype)
    cos, sin = rope_cos_sin(args, torch.arange(tokens.shape[1], device=device), dtype)
    # the fp32 causal attention materializes batch x heads x L^2 scores (SDPA's math path): 4.3 GB at 8 x 32
    # heads x 2048^2, more than the hidden states; long sequences go in smaller batches so the scores stay
    # under SCORES_BYTES (the statistics are sums over tokens: the same numbers, summed in another order)
    batch_size = max(1, min(batch_size, SCORES_BYTES // (4 * args.n_heads * tokens.shape[1] ** 2)))

    def observe(layer, name, t):
        for ob in observers:
            ob(layer, name, t)

    for i in range(start, args.n_layers):
        prefix = f"layers.{i}."
        h_in = h.clone() if requantize is not None else None
        sd = {k.removeprefix(prefix): v.to(device, dtype) for k, v in layer_state(i).items()}
        with torch.device("meta"):
            block = Block(args, i)
        block.load_state_dict(sd, strict=True, assign=True)
        for s in range(0, h.shape[0], batch_size):
            h[s : s + batch_size] = block(h[s : s + batch_size].to(device), cos, sin, observer=observe).to(home)
        del block, sd
        qblock = requantize(i) if requantize is not None else None
        if qblock is not None:
            for s in range(0, h.shape[0], batch_size):
                h[s : s + batch_size] = qblock(h_in[s : s + batch_size].to(device), cos, sin).to(home)
            del qblock
        del h_in
        if on_layer_end is not None:
            on_layer_end(i, h)
        if progress is not None:
            progress(i + 1, args.n_layers)
    return rms_norm(h, global_state["norm.weight"].to(home, dtype), args.norm_eps)


class ExpertTokenCounts:
    """Tokens routed to each expert of each MoE layer (a token counts once per expert it picks)."""

    def __init__(self, args: ModelArgs):
        self.counts = {i: torch.zeros(args.n_experts, dtype=torch.long)
                       for i, k in enumerate(args.ffn_kinds) if k == "moe"}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name == "expert_ids":
            self.counts[layer] += torch.bincount(t.flatten().cpu(), minlength=len(self.counts[layer]))

    def state_dict(self) -> dict:  # for a resumable calibration (resume.py)
        return {f"counts.{i}": c for i, c in self.counts.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.counts = {int(k.removeprefix("counts.")): v for k, v in sd.items()}


class KVRange:
    """Per-layer, per-channel max |k| (pre- and post-RoPE) and max |v| (MLA: of the latent rows, 'kv_latent'):
    the scale statistics the KV codecs calibrate from, and a cheap health check of what the model produces."""

    def __init__(self):
        self.stats: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name in ("k_pre", "k", "v", "kv_latent"):
            m = t.detach().abs().amax(dim=(0, 2)).float().cpu()  # [K, d]
            key = (layer, name)
            self.stats[key] = m if key not in self.stats else torch.maximum(self.stats[key], m)

    def state_dict(self) -> dict:  # for a resumable calibration (resume.py)
        return {f"stats.{layer}.{name}": t for (layer, name), t in self.stats.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.stats = {(int(k.split(".")[1]), k.split(".")[2]): t for k, t in sd.items()}
