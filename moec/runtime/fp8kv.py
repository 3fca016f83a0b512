"""The fp8 KV codec: keys and values stored as fp8 e4m3 with one static fp32 scale per layer and kind,
as vLLM's `kv_cache_dtype="fp8"` with calibrated scales and compressed-tensors' `kv_cache_scheme`
(num_bits 8, type float, strategy tensor, static, symmetric) store them, so `moec export --format ct`
carries it (moec/export/to_ct.py). A block codec of the tiered cache (the codec protocol is in
moec/runtime/nuq.py's docstring); the recipe `kv-fp8` keeps no fp16 window and no sinks, so only the last
partial block (fewer than `block` tokens) is fp16, where vLLM would hold fp8 too.

x ≈ fp8(clamp(x / scale, ±448)) · scale; the scales (amax / 448 over the calibration tokens, post-RoPE keys)
are per layer: kv.layers.{i}.k_scale and v_scale, fp32 [1]. Values beyond the calibrated amax saturate.
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from ..formats.kvsection import layer_tensor

E4M3_MAX = 448.0
PARTS = ("k_scale", "v_scale")


class FP8KVCodec:
    """fp8 e4m3 codes, one static scale per kind."""

    name = "fp8"

    def __init__(self, head_dim: int, k_scale: torch.Tensor, v_scale: torch.Tensor):
        self.bits, self.d, self.n_out = 8, head_dim, 0
        # python floats (exactly the fp32 scales): no per-call host-to-device copy, which CUDA-graph capture
        # of the static engine's step refuses
        self.scale = {"k": float(k_scale.float().reshape(())), "v": float(v_scale.float().reshape(()))}

    def fields(self, kind: str) -> dict[str, tuple[str, tuple, torch.dtype]]:
        return {"codes": ("token", (self.d,), torch.uint8)}  # e4m3 bit patterns

    def encode(self, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        q = (x.float() / self.scale[kind]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"codes": q.view(torch.uint8)}

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        return f["codes"].view(torch.float8_e4m3fn).float() * self.scale[kind]

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {"k_scale": torch.tensor([self.scale["k"]]), "v_scale": torch.tensor([self.scale["v"]])}


# -- registry hooks (moec/registry.py) ----------------------------------------------------------------

def fp8_tensor_names(section: dict, args) -> list[str]:
    return [layer_tensor(i, p) for i in range(args.n_layers) for p in PARTS]


def fp8_layer_codecs(section: dict, tensors: dict[str, torch.Tensor], args) -> list[FP8KVCodec]:
    """Per-layer FP8KVCodec; FormatError when a scale is missing, misshapen or not positive and finite."""
    codecs = []
    for i in range(args.n_layers):
        parts = {}
        for part in PARTS:
            name = layer_tensor(i, part)
            t = tensors.get(name)
            if t is None:
                raise FormatError(f"KV calibration tensor {name} is missing")
            if t.numel() != 1 or not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise FormatError(f"KV calibration tensor {name} must be one positive finite scale, got "
                                  f"shape {list(t.shape)}")
            parts[part] = t
        codecs.append(FP8KVCodec(args.head_dim, parts["k_scale"], parts["v_scale"]))
    extra = sorted(set(tensors) - set(fp8_tensor_names(section, args)))
    if extra:
        raise FormatError(f"KV calibration tensor {extra[0]} does not belong to a {args.n_layers}-layer model")
    return codecs


def ct_kv_cache(args, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """compressed-tensors' kv_cache_scheme of this codec and its scales under the attention modules, as
    llm-compressor writes them for vLLM: `model.layers.{i}.self_attn.k_scale` / `v_scale`, fp32 [1]
    (x = fp8 · scale in both)."""
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    return scheme, {f"model.layers.{i}.self_attn.{p}": tensors[layer_tensor(i, p)].float().reshape(1)
                    for i in range(args.n_layers) for p in PARTS}


def random_fp8_tensors(args, section: dict, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Stand-in calibration: scales around 4 / 448 (unit-variance keys and values mostly below 4)."""
    return {layer_tensor(i, p): (torch.rand(1, generator=gen) + 3.5) / E4M3_MAX
            for i in range(args.n_layers) for p in PARTS}
