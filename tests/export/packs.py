"""Small random packed checkpoints for the export tests (moec.calibrate.pack.pack_random: no calibration)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import parse_recipe
from moec.formats.checkpoint import load_tensors, read_manifest
from moec.runtime import weightcodecs
from moec.runtime.config import ModelArgs
from moec.runtime.experts import pop_quant_experts

# dims of multiples of 32 (Q4_1 blocks)
ARGS = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 max_seq_len=128, n_experts=4, top_k=2, expert_dim=64)


def rule(targets, codec, bits, group_size=0) -> dict:
    return {"targets": targets, "codec": codec, "bits": bits, "group_size": group_size}


def pack(path: Path, *rules: dict, args: ModelArgs = ARGS) -> Path:
    pack_random(args, "tiny", parse_recipe({"name": "export-test", "weights": list(rules)}), path)
    return path


def integer_zero_rtn(bits, shape, group_size, device, gen=None):
    """rtn parts whose zero is -k·scale (k an integer level), as a symmetric-range fit would give: scales
    of 4 significant bits, so -k·scale is exact in fp16 (pack_random's stand-in has zero = -7.5·scale)."""
    E, O, I = shape
    G = I // group_size if group_size else 1
    scale = (torch.randint(1, 16, (E, O, G), generator=gen) * 2.0 ** -10).half()
    k = torch.randint(0, 1 << bits, (E, O, G), generator=gen)
    return {"codes": weightcodecs._random_codes(bits, shape, device, gen), "scale": scale,
            "zero": (-k * scale.float()).half()}


def runtime_weights(path: Path) -> dict[str, torch.Tensor]:
    """{param: W [E, O, I] fp32} of every quantized matrix, as moec's runtime dequantizes it (QuantMatrix)."""
    m = read_manifest(path)
    return {p: q.dequant_ref() for p, q in pop_quant_experts(load_tensors(path, m), m).items()}


def ct_decompressed(out: Path) -> dict[str, torch.Tensor]:
    """{HF module name: weight} of every quantized module, decompressed by compressed-tensors from the files."""
    # imported here, not at collection: the library pulls ~6 s of transformers internals, which only the
    # xdist worker that runs these tests should pay
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    got = {}
    with safe_open(out / "model.safetensors", "pt") as h:
        keys = list(h.keys())  # noqa: SIM118 (safe_open handles are not mappings)
        modules = [k.removesuffix(".weight_scale") for k in keys if k.endswith(".weight_scale")]
        for m in modules:  # its scheme: the group naming it (name or regex), else the `Linear` group, unless ignored
            assert not any(match_name(m, t) for t in qc.ignore), m
            scheme = next((g for g in qc.config_groups.values() if any(match_name(m, t) for t in g.targets)), None) \
                or next(g for g in qc.config_groups.values() if g.targets == ["Linear"])
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            sd = {k.removeprefix(m + "."): h.get_tensor(k) for k in keys if k.startswith(m + ".")}
            got[m] = compressor.decompress(sd, scheme)["weight"]
    return got
