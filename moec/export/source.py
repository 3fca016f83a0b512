"""The packed checkpoint as export sees it: each canonical parameter with its codec and stored parts, and
which export formats can carry it exactly (`carriers`), with the reason for each that cannot.

Shape legend: E = experts, O = output rows, I = inputs, G = groups per row, g = I / G, K = 2^bits.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..formats.checkpoint import MANIFEST, check_model_fields, load_tensors, source_hf_config, verify
from ..formats.codecs import ROTATION_PART
from ..registry import resolve, stored_as_is, weight_codec
from ..runtime.config import ModelArgs
from ..runtime.experts import HEAD_PARAM, ROUTER_PARAM
from ..runtime.loader import check_quant_parts

log = logging.getLogger(__name__)


@dataclass
class Param:
    """One canonical parameter: `tensor` when kept, else its codec's stored parts (`parts`, stacked
    [E, O, ...]; attention projections get E = 1 here, as the runtime's QuantMatrix gives them)."""

    name: str
    codec: str
    bits: int
    shape: tuple[int, ...]  # canonical shape ([O, I] for attention, [E, O, I] for experts)
    tensor: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def kept(self) -> bool:
        """Stored as the source has it (`tensor`), not as a codec's parts."""
        return self.tensor is not None

    @property
    def group(self) -> int:
        """Inputs per group (g) of a grouped codec."""
        return self.shape[-1] // self.parts["scale"].shape[-1]


class PackedModel:
    """A verified packed checkpoint: `manifest`, `args`, `config` (the HF config.json it carries, without
    moec's own quantization_config) and `params` {canonical name: Param} in manifest order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = verify(self.path)
        if self.manifest.get("layout") == "hf":
            raise UserError(f"{self.path}: packed on the transformers path (layout hf); export maps moec's canonical "
                            f"tensors only")
        check_model_fields(self.manifest, self.path / MANIFEST)
        check_quant_parts(self.path, self.manifest)  # parts, shapes and dtypes each codec stores (untrusted input)
        self.args = ModelArgs.from_dict(self.manifest["model_args"])
        cfg = self.path / "config.json"
        self.config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        self.config = source_hf_config(self.config)  # the source's model_type, without moec's mirror
        # the KV codec and its calibration tensors (export/__init__.py says which format carries which codec)
        self.kv_codec = self.manifest["recipe"]["kv"]["codec"] if self.manifest.get("kv") else None
        tensors = load_tensors(self.path, self.manifest)
        self.kv_tensors = {n: t for n, t in tensors.items() if n.startswith("kv.")}
        self.params: dict[str, Param] = {}
        for name, e in self.manifest["tensors"].items():
            if name.startswith("kv."):  # KV-codec calibration tensors: kv_tensors
                continue
            p = e["param"]
            if stored_as_is(e["codec"]):
                self.params[name] = Param(name, e["codec"], e["bits"], tuple(tensors[name].shape), tensors[name])
                continue
            if p not in self.params:
                if HEAD_PARAM.search(p) or ROUTER_PARAM.search(p):  # moec-only: eval/generate run them
                    raise UserError(f"{p} ({e['codec']}, {e['bits']} bits): no export format here carries a quantized "
                                    f"{'LM head' if HEAD_PARAM.search(p) else 'router'}: export a recipe that keeps it")
                self.params[p] = Param(p, e["codec"], e["bits"], tuple(e.get("param_shape") or ()))
            if name == f"{p}.{ROTATION_PART}":  # W stored as W·R: the other runtimes do not rotate inputs
                raise UserError(f"{p} ({e['codec']}, {e['bits']} bits) was fitted with incoherence processing "
                                f"(a block-Hadamard rotation of its inputs that only moec applies); no export "
                                f"format carries it: export a recipe without `incoherence`")
            part = tensors[name]
            if len(self.params[p].shape) == 2:  # attention: stored without the E axis
                part = part[None]
            self.params[p].parts[name.removeprefix(p + ".")] = part


# -- which format carries what ----------------------------------------------------------------------------

def rtn_zero_points(p: Param) -> torch.Tensor | None:
    """Integer zero points k [E, O, G] (0 <= k < K) with zero + scale·q == (q - k)·scale bit for bit in fp32
    for every level q (what compressed-tensors computes), or None when some group's zero is not one."""
    scale, zero = p.parts["scale"].float(), p.parts["zero"].float()
    K = 1 << p.bits
    k = torch.where(scale == 0, torch.zeros_like(zero), (-zero / scale).round())
    if not bool(((k >= 0) & (k < K)).all()):
        return None
    q = torch.arange(K, dtype=torch.float32)
    moec = zero[..., None] + scale[..., None] * q  # runtime/weightcodecs.lut_rtn
    ct = (q - k[..., None]) * scale[..., None]
    return k.to(torch.int32) if torch.equal(moec, ct) else None


FORMATS = ("gguf", "ct")
# what a format says of a codec that registers no export hook for it (WeightCodecSpec.exports)
NO_FORMAT = {"gguf": "GGUF has no type for {} levels",
             "ct": "compressed-tensors has no format for {} levels (per-group codebooks or a fixed grid)"}


def carry_reason(p: Param, fmt: str) -> str | None:
    """Why export format `fmt` cannot carry `p` exactly (None: it can): the codec's registered export hook
    says (moec/registry.py WeightCodecSpec.exports); a kept tensor goes anywhere as it is."""
    spec = weight_codec(p.codec)
    if spec.identity:
        return None
    hook = spec.exports.get(fmt)
    return NO_FORMAT[fmt].format(p.codec) if hook is None else resolve(hook)(p)


def export_tensors(p: Param, fmt: str, *args):
    """What format `fmt` writes for the quantized `p` (its codec's export_tensors hook; refuse_unless_carried
    has checked that it carries `p`)."""
    return resolve(weight_codec(p.codec).export_tensors[fmt])(p, *args)


def refuse_unless_carried(model: PackedModel, fmt: str) -> None:
    """UserError naming the first parameter `fmt` cannot carry, its codec, and the formats that can."""
    for p in model.params.values():
        why = carry_reason(p, fmt)
        if why is None:
            continue
        others = [f for f in FORMATS if f != fmt and carry_reason(p, f) is None]
        where = f"it exports to --format {' or '.join(others)}" if others else \
            "no export format carries it exactly (moec eval/generate run it)"
        raise UserError(f"{p.name}: codec {p.codec} {p.bits}-bit cannot be exported as {fmt}: {why}; {where}")
