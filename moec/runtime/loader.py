"""Load a model for the runtime: an HF-layout directory or a moec packed checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import FormatError
from ..formats import checkpoint
from ..formats.codecs import KEEP, WEIGHT_PATTERN
from .config import ModelArgs
from .experts import attach, is_quant_attention, is_quant_expert, placeholders, pop_quant_experts
from .hf_layout import HFCheckpoint
from .model import Transformer, build_model


def weight_bits(tensors: dict[str, torch.Tensor]) -> float:
    """Effective bits per weight of the decoder-layer matrices, from the bytes held."""
    nbytes = numel = 0
    for name, t in tensors.items():
        if WEIGHT_PATTERN.search(name):
            nbytes += t.numel() * t.element_size()
            numel += t.numel()
    return 8.0 * nbytes / max(numel, 1)


def load_state(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor], dict]:
    """(args, canonical state dict, info) where info has kind, w_bits and, for packed, the manifest."""
    if checkpoint.is_packed(path):
        manifest = checkpoint.verify(path)
        args = ModelArgs.from_dict(manifest["model_args"])
        for name, e in manifest["tensors"].items():
            if e["codec"] != KEEP and not name.startswith("kv.") and not is_quant_expert(name, e) \
                    and not is_quant_attention(name, e):
                raise FormatError(f"{path}: tensor {name!r} uses codec {e['codec']!r}, which this runtime "
                                  f"version cannot execute")
        state = checkpoint.load_tensors(path, manifest)
        kv_tensors = {n: state.pop(n) for n in [n for n in state if n.startswith("kv.")]}  # KV codec calibration
        return args, state, {"kind": "packed", "manifest": manifest, "kv": manifest.get("kv"),
                             "kv_tensors": kv_tensors, "w_bits": manifest["effective_bits"]["w_bits"]}
    ckpt = HFCheckpoint(path)
    state = ckpt.state_dict()
    return ckpt.args, state, {"kind": "hf", "w_bits": weight_bits(state)}


def load_model(path: str | Path, dtype: torch.dtype | None = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Transformer, dict]:
    """The runtime model for `path`; compute dtype fp32 by default (the CPU reference)."""
    args, state, info = load_state(path)
    quant = pop_quant_experts(state, info.get("manifest"))  # quantized experts: built apart, then attached
    model = build_model(args, state | placeholders(quant, dtype, device), dtype=dtype, device=device)
    attach(model, quant, device)
    return model, info


def kv_codec_spec(section: dict):
    """The registered spec of a checkpoint's KV codec (FormatError: a codec this moec does not know)."""
    from ..registry import kv_codecs

    codecs = kv_codecs()
    spec = codecs.get(section["codec"])
    if spec is None or spec.name == "fp16":
        raise FormatError(f"KV codec {section['codec']!r} is not one this runtime executes "
                          f"(registered: {', '.join(c for c in codecs if c != 'fp16')})")
    return spec


def kv_cache_factory(info: dict, args: ModelArgs):
    """The cache factory `evaluate` takes, for the KV codec a packed checkpoint records (None: fp16), from
    the codec's registered spec: the tiered cache for block codecs, the codec's own cache otherwise.

    Checks the checkpoint's KV calibration against the model's layer/head shapes (FormatError)."""
    section = info.get("kv")
    if not section:
        return None
    spec, tensors = kv_codec_spec(section), info.get("kv_tensors", {})
    if spec.tiered:
        from .kvtiered import build_codecs, tiered_cache_factory

        return tiered_cache_factory(section, build_codecs(section, tensors, args))
    return spec.hook("cache_factory")(section, tensors, args)
