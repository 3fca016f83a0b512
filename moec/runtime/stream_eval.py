"""Teacher-forced evaluation with one decoder layer's weights on the device at a time (`moec eval
--stream-layers`, or by itself when the model does not fit the device): for a model larger than the GPU.

All windows go through layer 0, then layer 1, ...: the hidden states of every window [n, W, D] are held
(8 × 1024 × 4096 fp32 is 134 MB) instead of the model. Each layer is read from the checkpoint when its
turn comes (packed: its tensors by name, checkpoint.load_tensors; HF: HFCheckpoint.layer_state) and
built like load_model builds it (quantized experts and attention attached), so the numbers are those of
the in-memory path (tests/runtime/test_stream_eval.py). KL needs the baseline's log-probs saved by an
earlier eval (`--baseline-logits`): a second model in memory is what streaming avoids.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from ..formats import checkpoint
from ..registry import stored_as_is
from .config import ModelArgs
from .experts import QLinear, attach, placeholders, pop_quant_experts
from .hf_layout import HFCheckpoint
from .loader import open_packed
from .model import Block, rms_norm, rope_cos_sin
from .perplexity import CONTEXT, Totals, shares

_LAYER = re.compile(r"layers\.(\d+)\.")


class LayerSource:
    """The model at `path` read piecewise: args, the global tensors, and block(i) built on demand."""

    def __init__(self, path: str | Path, dtype: torch.dtype, device: str):
        self.path, self.dtype, self.device = Path(path), dtype, device
        if checkpoint.is_packed(path):
            self.args, self.manifest = open_packed(path)
            names = [n for n in self.manifest["tensors"] if not n.startswith("kv.")]
            self._layer_names: dict[int, list[str]] = {}
            for n in names:
                m = _LAYER.match(n)
                if m:
                    self._layer_names.setdefault(int(m.group(1)), []).append(n)
            self._global_names = [n for n in names if not _LAYER.match(n)]
        else:
            self.manifest, self.hf = None, HFCheckpoint(path)
            self.args: ModelArgs = self.hf.args

    def global_state(self) -> dict[str, torch.Tensor]:
        self.head = None  # a quantized LM head (a QLinear), else lm_head reads output.weight
        if self.manifest is None:
            sd = self.hf.global_state()
        else:
            sd = checkpoint.load_tensors(self.path, self.manifest, self._global_names)
            quant = pop_quant_experts(sd, {"tensors": {n: self.manifest["tensors"][n] for n in sd}})
            if quant:
                self.head = QLinear(quant.pop("output.weight").to(self.device), None)
                assert not quant, sorted(quant)  # the LM head is the one quantized global tensor
        return {k: v.to(self.device, self.dtype) for k, v in sd.items()}

    def block(self, i: int) -> Block:
        """Layer i as load_model builds it: keep tensors at the compute dtype, quantized ones attached."""
        if self.manifest is None:
            state, quant = self.hf.layer_state(i), {}
        else:
            state = checkpoint.load_tensors(self.path, self.manifest, self._layer_names[i])
            quant = pop_quant_experts(state, {"tensors": {n: self.manifest["tensors"][n] for n in state}})
        return build_block(self.args, i, state, quant, self.dtype, self.device)

    def lm_head(self, glob: dict, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, glob["norm.weight"], self.args.norm_eps)
        if getattr(self, "head", None) is not None:
            return self.head(h)
        w = glob["tok_embeddings.weight"] if self.args.tie_embeddings else glob["output.weight"]
        return h @ w.t()


def build_block(args: ModelArgs, i: int, state: dict[str, torch.Tensor], quant: dict, dtype: torch.dtype,
                device) -> Block:
    """Decoder layer i from its canonical tensors (`layers.i.*`, quantized params popped into `quant`:
    experts.pop_quant_experts), as load_model builds a layer."""
    prefix = f"layers.{i}."
    sd = {k: v.to(device, dtype) for k, v in state.items()} | placeholders(quant, dtype, device)
    with torch.device("meta"):
        block = Block(args, i)
    block.load_state_dict({k.removeprefix(prefix): v for k, v in sd.items()}, strict=True, assign=True)
    attach(SimpleNamespace(layers={i: block}), quant, device)  # attach finds layer i in .layers
    return block.eval()


@torch.no_grad()
def evaluate_streamed(src: LayerSource, windows: torch.Tensor, saved=None, record=None,
                      progress: Callable[[int], None] | None = None) -> dict:
    """ppl_tf (and kld/top1 against `saved` log-probs) over `windows` [n, W], layer by layer.

    saved / record as perplexity.evaluate takes them; progress(n) as perplexity.evaluate calls it, in
    scored positions: each window's W − CONTEXT spread over the layers, reported per layer and window."""
    n, W = windows.shape
    assert W > CONTEXT + 1, f"window {W} must exceed the {CONTEXT}-token context"
    glob = src.global_state()
    x = windows.to(src.device)
    h = torch.nn.functional.embedding(x, glob["tok_embeddings.weight"])  # [n, W, D]
    cos, sin = rope_cos_sin(src.args, torch.arange(W, device=src.device), h.dtype)
    share = shares(W - CONTEXT, src.args.n_layers)
    for i in range(src.args.n_layers):
        block = src.block(i)
        for b in range(n):  # one window at a time, as the in-memory path runs them
            h[b : b + 1] = block(h[b : b + 1], cos, sin)
            if progress is not None:
                progress(share[i])
        del block
    tot = Totals()
    for b in range(n):
        logits = src.lm_head(glob, h[b, CONTEXT - 1 : W - 1])
        base = saved("tf", slice(b, b + 1), slice(None))[0].to(src.device) if saved is not None else None
        if record is not None:
            record("tf", slice(b, b + 1), slice(None), logits[None])
        tot.add(logits, x[b, CONTEXT:], base)
    out = tot.result(saved is not None)
    out["windows"], out["window_len"] = n, W
    return out


def model_bytes(src: LayerSource) -> int:
    """Bytes the in-memory model takes on the device: keep tensors at the compute dtype, quantized parts
    as stored (what load_model holds), for the automatic choice of streaming."""
    size = torch.empty((), dtype=src.dtype).element_size()
    if src.manifest is None:
        return sum(t.numel() * size for t in src.hf.meta_state_dict().values())
    total = 0
    for e in src.manifest["tensors"].values():
        numel = 1
        for d in e["shape"]:
            numel *= d
        total += numel * size if stored_as_is(e["codec"]) else e["bytes"]
    return total
