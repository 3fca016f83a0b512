"""compressed-tensors export: an HF model directory (HF tensor names, one Linear per expert as HF
checkpoints store them on disk and llm-compressor writes them for vLLM, config.json with a
`quantization_config`). The library decompresses it exactly (tests/export/test_export_ct.py); vLLM is not run
here. transformers 5.17 fuses MoE experts into 3-D parameters (`experts.gate_up_proj`) and dequantizes them at
load from the scheme of the group that targets the class `Linear` (`_targets`); it loads the export with the
logits of moec's dequantized weights (tests/export/test_export_hf_load.py; at fp32 after `.to(torch.float32)`:
it keeps the tensors it renames in their stored dtype).

Mappings (compressed_tensors.compressors; checked with the library in tests/export/test_export_ct.py):
  rtn -> `pack-quantized`, int, asymmetric, strategy group (g = the group size) or channel (one group per
      row). The library computes w = (q - zp)·scale in the scale's dtype, with q = code - 2^(b-1) and
      zp = k - 2^(b-1) (both stored offset by 2^(b-1)). moec computes w = zero + scale·code, so the export
      takes k = -zero / scale, and is exact only when every level agrees bit for bit in fp32
      (source.rtn_zero_points); scales are written as fp32 so the library's arithmetic is fp32 too
      ((code - k)·scale, an fp16 scale times an integer below 2^bits, is exact there).
      `weight_packed` int32 [O, ceil(I·b/32)]: code j of a row at bit j·b of the row's bit string, words
      little-endian (32 codes fill b words); `weight_zero_point` the same packing of k along O
      (int32 [ceil(O·b/32), G]); `weight_scale` fp32 [O, G]; `weight_shape` int64 [2].
  intsym -> `pack-quantized`, int, symmetric (no zero point), group or channel: below (intsym_tensors).
  fp8 -> `float-quantized`, float 8-bit, channel: `weight` e4m3 [O, I] and `weight_scale` fp32 [O, 1];
      the library computes fp8.float() · scale, moec the same product.
  nvfp4 -> `nvfp4-pack-quantized`, float 4-bit, strategy tensor_group, groups of 16: `weight_packed` uint8
      [O, I/2] (moec's codes as they are: both put input 2j in the low nibble of byte j, as e2m1 patterns),
      `weight_scale` e4m3 [O, I/16], `weight_global_scale` fp32 [1] (the divisor, as moec stores it). The
      library decodes into bf16: e2m1 · (bf16(e4m3) / global_scale) in fp32, rounded to bf16, which equals
      moec's fp32 weight when the global scale is a power of two (moec's fit writes only such; any other is
      refused, since its products would round).
  keep -> the tensor as stored, under its HF name.
  KV fp8 (runtime/fp8kv.py) -> `kv_cache_scheme` {num_bits 8, float, symmetric, strategy tensor, static} and
      `model.layers.{i}.self_attn.k_scale` / `v_scale` fp32 [1]: both x = fp8 · scale, post-RoPE keys.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..atomic import atomic_dir
from ..errors import UserError
from ..formats import bitpack
from ..formats.checkpoint import MANIFEST, SHARD_BYTES
from ..runtime.config import ModelArgs
from ..runtime.hf_layout import MLA_LINEARS, MLA_NORMS, SHARED_EXPERTS_ARCHS
from .source import PackedModel, Param, export_tensors, refuse_unless_carried, rtn_zero_points
from .to_gguf import EXPORT_INFO, is_export

EXPERTS = re.compile(r"layers\.\d+\.moe\.w[123]$")  # stacked experts (or a dense MLP: ffn_kinds tells)
_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"} | MLA_LINEARS
_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
          "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
          "moe.score_bias": "mlp.gate.e_score_correction_bias",
          **{f"attn.{c}.weight": f"self_attn.{h}.weight" for c, h in MLA_NORMS.items()}}
_GLOBAL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def hf_names(name: str, args: ModelArgs) -> list[str]:
    """HF parameter names of a canonical parameter (hf_layout.py in reverse); stacked experts give one
    name per expert, in expert order."""
    if name in _GLOBAL:
        return [_GLOBAL[name]]
    _, i, rest = name.split(".", 2)
    p = f"model.layers.{i}."
    moe = "block_sparse_moe" if args.arch == "mixtral" else "mlp"
    if rest in _NORMS:
        return [p + _NORMS[rest]]
    if rest.startswith("attn.w"):
        c, kind = rest.removeprefix("attn.").split(".")
        return [f"{p}self_attn.{_ATTN[c]}.{kind}"]
    if rest == "moe.router.weight":
        return [f"{p}{moe}.gate.weight"]
    if rest.startswith("moe.shared.w"):
        shared = "shared_experts" if args.arch in SHARED_EXPERTS_ARCHS else "shared_expert"
        return [f"{p}mlp.{shared}.{_MLP[rest.split('.')[2]]}.weight"]
    if rest in ("moe.w1", "moe.w3", "moe.w2"):
        c = rest[-2:]
        if args.ffn_kinds[int(i)] == "dense":
            return [f"{p}mlp.{_MLP[c]}.weight"]
        h = c if args.arch == "mixtral" else _MLP[c]
        return [f"{p}{moe}.experts.{e}.{h}.weight" for e in range(args.n_experts)]
    raise UserError(f"{name}: no Hugging Face name known for this parameter")


def pack_int32(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, n] < 2^bits -> int32 [R, ceil(n·bits/32)]: compressed-tensors' pack_to_int32
    layout (code j at bit j·bits of the row's bit string, 32-bit words, least significant bit first)."""
    out = []
    for rows in v.split(1024):  # bounds the bit tensor at 1024·n·bits int64
        b = ((rows.long()[..., None] >> torch.arange(bits)) & 1).flatten(-2)
        b = F.pad(b, (0, -b.shape[-1] % 32)).view(rows.shape[0], -1, 32)
        words = (b << torch.arange(32)).sum(-1)  # [r, W] in [0, 2^32)
        out.append(torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32))
    return torch.cat(out)


def _module_tensors(p: Param, names: list[str]) -> tuple[dict[str, torch.Tensor], dict | None]:
    """({HF tensor name: tensor}, the scheme's weight args or None when kept) of one parameter."""
    if p.kept:
        stacked = p.name.rsplit(".", 1)[-1] in ("w1", "w2", "w3")  # [E, O, I], one HF name per expert
        return ({n: p.tensor[e] for e, n in enumerate(names)} if stacked else {names[0]: p.tensor}), None
    return export_tensors(p, "ct", names)  # the codec's registered mapping (moec/codecs/)


def fp8_reason(p: Param) -> None:
    """The fp8 codec's compressed-tensors hook: float-quantized e4m3 with per-channel scales carries it."""
    return None


def fp8_tensors(p: Param, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """fp8 as float-quantized, one fp32 scale per output channel."""
    out = {}
    for e, n in enumerate(names):
        m = n.removesuffix(".weight")
        out[m + ".weight"] = p.parts["fp8"][e].contiguous()
        out[m + ".weight_scale"] = p.parts["scale"][e].float()[:, None].contiguous()
    return out, {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}


def rtn_reason(p: Param) -> str | None:
    """The rtn codec's compressed-tensors hook: pack-quantized needs integer zero points."""
    if rtn_zero_points(p) is not None:
        return None
    return ("pack-quantized needs an integer zero point (zero = -k·scale, 0 <= k < 2^bits); this rtn's zeros "
            "are fractional multiples of its scales")


def rtn_tensors(p: Param, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """rtn as pack-quantized: int32-packed codes, fp32 scales, packed integer zero points."""
    out = {}
    k = rtn_zero_points(p)  # [E, O, G], checked by refuse_unless_carried
    I, G = p.shape[-1], p.parts["scale"].shape[-1]
    codes = bitpack.unpack(p.parts["codes"], p.bits, I)
    for e, n in enumerate(names):
        m = n.removesuffix(".weight")
        out[m + ".weight_packed"] = pack_int32(codes[e], p.bits)
        out[m + ".weight_scale"] = p.parts["scale"][e].float().contiguous()
        out[m + ".weight_zero_point"] = pack_int32(k[e].T, p.bits).T.contiguous()
        out[m + ".weight_shape"] = torch.tensor([p.parts["codes"].shape[1], I])
    group = {"strategy": "channel"} if G == 1 else {"strategy": "group", "group_size": I // G}
    return out, {"num_bits": p.bits, "type": "int", "symmetric": False, **group, "dynamic": False}


# -- intsym (moec/codecs/intsym.py) -> pack-quantized, symmetric ------------------------------------------------
# What llm-compressor's W4A16 / W8A16 write and vLLM's Marlin (WNA16) kernels take: `weight_packed` int32
# [O, ceil(I·b/32)] of u = q + 2^(b-1) (compressed-tensors' pack_to_int32: the library packs q + 2^(b-1) too),
# `weight_scale` [O, G], `weight_shape`, no zero point (symmetric). The library computes w = q·scale in the
# scale's dtype; the scales go as fp32, so that product is moec's (exact: an fp16 scale times an integer of
# at most 8 bits). vLLM casts the scale to the model's dtype at load: exact at fp16, rounded at bf16.

def intsym_reason(p: Param) -> None:
    """The intsym codec's compressed-tensors hook: pack-quantized carries any group and both widths."""
    return None


def intsym_tensors(p: Param, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """intsym as symmetric pack-quantized: int32-packed codes, fp32 scales."""
    out = {}
    I, G = p.shape[-1], p.parts["scale"].shape[-1]
    codes = bitpack.unpack(p.parts["codes"], p.bits, I)  # [E, O, I], q + 2^(b-1)
    for e, n in enumerate(names):
        m = n.removesuffix(".weight")
        out[m + ".weight_packed"] = pack_int32(codes[e], p.bits)
        out[m + ".weight_scale"] = p.parts["scale"][e].float().contiguous()
        out[m + ".weight_shape"] = torch.tensor([codes.shape[1], I])
    group = {"strategy": "channel"} if G == 1 else {"strategy": "group", "group_size": I // G}
    return out, {"num_bits": p.bits, "type": "int", "symmetric": True, **group, "dynamic": False}


def nvfp4_reason(p: Param) -> str | None:
    """The nvfp4 codec's compressed-tensors hook: nvfp4-pack-quantized carries it exactly where every weight
    survives the library's bf16 decode (power-of-two global scales)."""
    from ..runtime.fp4 import dequantize_nvfp4

    w = dequantize_nvfp4(p.bits, (p.parts["codes"].shape[0], p.parts["codes"].shape[1], p.shape[-1]), p.parts)
    if torch.equal(w.bfloat16().float(), w):
        return None
    return ("compressed-tensors decodes nvfp4 into bf16 and this matrix's weights are not all bf16 values (a global "
            "scale that is not a power of two)")


def nvfp4_tensors(p: Param, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """nvfp4 as nvfp4-pack-quantized: packed codes, e4m3 block scales, the fp32 global scale per expert."""
    out = {}
    gs = p.parts["global_scale"].float().reshape(-1)  # [E]
    for e, n in enumerate(names):
        m = n.removesuffix(".weight")
        out[m + ".weight_packed"] = p.parts["codes"][e].contiguous()
        out[m + ".weight_scale"] = p.parts["scale"][e].contiguous()
        out[m + ".weight_global_scale"] = gs[e : e + 1].contiguous()
    return out, {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                 "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "format": "nvfp4-pack-quantized"}


def kv_ct_hook(model: PackedModel):
    """The KV codec's registered `ct_kv_cache` hook, or None (no KV codec, or one ct does not carry)."""
    from ..registry import kv_codec

    spec = kv_codec(model.kv_codec) if model.kv_codec else None
    return spec.hook("ct_kv_cache") if spec is not None and spec.ct_kv_cache else None


def write_ct(model: PackedModel, out: Path) -> dict:
    refuse_unless_carried(model, "ct")
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, dict] = {}  # scheme key -> config group
    kept_linears = ["lm_head"]  # HF modules of kept matrices: `ignore` of a class-name target (_targets)
    expert_group = None
    for p in model.params.values():
        names = hf_names(p.name, model.args)
        ts, weights = _module_tensors(p, names)
        tensors.update(ts)
        if weights is None:
            if p.tensor.dim() >= 2 and p.name != "tok_embeddings.weight":
                kept_linears += [n.removesuffix(".weight") for n in names if n != "lm_head.weight"]
            continue
        fmt = weights.pop("format", None) or ("float-quantized" if weights["type"] == "float" else "pack-quantized")
        key = json.dumps([fmt, weights], sort_keys=True)
        g = groups.setdefault(key, {"targets": [], "weights": weights, "input_activations": None,
                                    "output_activations": None, "format": fmt})
        g["targets"] += [n.removesuffix(".weight") for n in names]
        if EXPERTS.search(p.name) and model.args.ffn_kinds[int(p.name.split(".")[1])] == "moe":
            expert_group = expert_group or key
    quantized_modules = sum(len(g["targets"]) for g in groups.values())
    groups, ignore = _targets(groups, expert_group, kept_linears)
    formats = {g["format"] for g in groups.values()}
    kv_scheme, kv_hook = None, kv_ct_hook(model)
    if kv_hook is not None:  # a KV codec ct carries (fp8): its scheme and per-layer scales
        kv_scheme, kv_scales = kv_hook(model.args, model.kv_tensors)
        tensors.update(kv_scales)
    qcfg = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": (formats.pop() if len(formats) == 1 else "mixed-precision") if groups else "dense",
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
            "ignore": ignore if groups else [], "kv_cache_scheme": kv_scheme,
            } if groups or kv_scheme else None  # nothing quantized: a plain HF directory
    shards = _shards(tensors)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with atomic_dir(out, is_output=is_export, what="a moec export", size_hint=size) as tmp:
        weight_map = {}
        for i, group in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in group.items()}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, fname))
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1))
        cfg = {**model.config, **({"quantization_config": qcfg} if qcfg else {})}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        # the packed shards and their index are replaced by the export's own (written above)
        kept = {MANIFEST, "config.json", "model.safetensors.index.json", *model.manifest["shards"]}
        for f in sorted(model.path.iterdir()):  # tokenizer, generation config, the recipe
            if f.is_file() and not f.is_symlink() and f.name not in kept:
                shutil.copy2(f, tmp / f.name)
        info = {"format": "ct", "source": str(model.path), "quantization_format": qcfg["format"] if qcfg else None,
                "quantized_modules": quantized_modules, "tensors": len(tensors)}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    return info


def _targets(groups: dict[str, dict], expert_group: str | None, kept: list[str]) -> tuple[dict[str, dict], list[str]]:
    """(config groups, ignore) as llm-compressor writes a MoE: the group quantizing the experts targets the class
    `Linear` (vLLM takes a fused-MoE layer's scheme from it), every kept linear module is in `ignore`, and any
    other group names its modules by anchored regexes, placed before the `Linear` group. Why: transformers fuses
    a MoE layer's experts into 3-D parameters, so per-expert module names match nothing there (compressed-tensors
    printed one "Could not match" line for each); its expert loader (DecompressExperts) takes the experts' scheme
    from the first group with a target that is not a regex; compressed-tensors stops at the first target a module
    matches (a plain name listed after `Linear` would be reported unmatched), and it and vLLM rank a regex above a
    class, so each named module keeps its own group's scheme."""
    if expert_group is None:  # every target is a module transformers builds: names, nothing ignored
        return groups, []
    named = {k: dict(g, targets=[f"re:^{re.escape(t)}$" for t in g["targets"]])
             for k, g in groups.items() if k != expert_group}
    return {**named, expert_group: dict(groups[expert_group], targets=["Linear"])}, kept


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards
