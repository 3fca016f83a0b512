"""Adding a codec without touching the package: a toy KV codec and a toy weight codec registered from
this module alone run through calibrate → pack → eval on demo-moe (the CLI imports this module through
MOEC_PLUGINS), and the KV one through the static decode engine on the CPU.

toy-int8 (KV, a tiered block codec): keys divided by a per-channel scale calibrated offline (the
absmax of calibration keys), values by their per-token absmax, both rounded to int8.
toy-int8w (weights): per-row absmax int8, no Hessian.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from moec.codecs.base import TieredConfig
from moec.registry import KV_CODECS, WEIGHT_CODECS, KVCodecSpec, WeightCodecSpec, register_kv, register_weight

# -- the toy KV codec -----------------------------------------------------------------------------------


@dataclass
class ToyKVConfig(TieredConfig):
    clip: float = 1.0  # key scale = clip · calibrated absmax


class AbsmaxSampler:
    """Capture observer: per-layer, per-channel max |k| [K, d] of the calibration tokens."""

    def __init__(self):
        self.absmax: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name == "k":
            m = t.detach().abs().amax(dim=(0, 2)).float().cpu()
            self.absmax[layer] = m if layer not in self.absmax else torch.maximum(self.absmax[layer], m)


class ToyLayerCodec:
    name = "toy-int8"
    bits = 8
    n_out = 0

    def __init__(self, k_scale: torch.Tensor):
        self.k_scale = k_scale.clamp_min(1e-6) / 127  # [K, d]

    def fields(self, kind: str) -> dict:
        f = {"codes": ("token", (self.k_scale.shape[1],), torch.int8)}
        return f if kind == "k" else f | {"scale": ("token", (), torch.float16)}

    def encode(self, x: torch.Tensor, kind: str) -> dict:
        if kind == "k":
            return {"codes": (x / self.k_scale.to(x.device)[:, None]).round().clamp(-127, 127).to(torch.int8)}
        s = (x.abs().amax(-1) / 127).clamp_min(1e-8).half()
        return {"codes": (x / s.float()[..., None]).round().clamp(-127, 127).to(torch.int8), "scale": s}

    def decode(self, f: dict, kind: str) -> torch.Tensor:
        if kind == "k":
            return f["codes"].float() * self.k_scale.to(f["codes"].device)[:, None]
        return f["codes"].float() * f["scale"].float()[..., None]

    def static_tensors(self) -> dict:
        return {"k_scale": self.k_scale}


def _names(section, args):
    return [f"kv.layers.{i}.k_absmax" for i in range(args.n_layers)]


def _fit(args, cfg, sampler, device):
    tensors = {f"kv.layers.{i}.k_absmax": sampler.absmax[i] * cfg.clip for i in range(args.n_layers)}
    return tensors, {"codec": cfg.codec, "clip": cfg.clip}


def _layer_codecs(section, tensors, args):
    return [ToyLayerCodec(tensors[f"kv.layers.{i}.k_absmax"]) for i in range(args.n_layers)]


def _random(args, section, gen, device):
    shape = (args.n_kv_heads, args.head_dim)
    return {n: torch.rand(shape, generator=gen).to(device) + 0.5 for n in _names(section, args)}


# -- the toy weight codec -------------------------------------------------------------------------------

def _wquantize(W, H, rule):
    scale = (W.abs().amax(-1) / 127).clamp_min(1e-12)  # [E, O]
    return {"q": (W / scale[..., None]).round().clamp(-127, 127).to(torch.int8), "scale": scale}


def _wdequantize(bits, shape, stored):
    return stored["q"].float() * stored["scale"].float()[..., None]


def _wrandom(bits, shape, group_size, device, gen=None):
    q = torch.randint(-127, 128, shape, dtype=torch.int8, device=device, generator=gen)
    return {"q": q, "scale": torch.full(shape[:2], 1e-3, device=device)}


if "toy-int8" not in KV_CODECS:
    register_kv(KVCodecSpec("toy-int8", config=ToyKVConfig, bits=(8,), sampler=lambda cfg, seed: AbsmaxSampler(),
                            fit=_fit, tensor_names=_names, layer_codecs=_layer_codecs, random_tensors=_random))
if "toy-int8w" not in WEIGHT_CODECS:
    register_weight(WeightCodecSpec("toy-int8w", bits=(8,), quantize=_wquantize, dequantize=_wdequantize,
                                    random_stored=_wrandom))

RECIPE = {"name": "toy", "kv": {"codec": "toy-int8", "bits": 8, "window": 16, "sinks": 2, "block": 16},
          "weights": [{"targets": ["experts"], "codec": "toy-int8w", "bits": 8}]}


def test_toy_codecs_end_to_end(tmp_path, monkeypatch):
    import yaml

    from tests.cli.run import moec

    monkeypatch.setenv("MOEC_PLUGINS", __name__)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    calib, packed, out = tmp_path / "calib", tmp_path / "packed", tmp_path / "eval.json"
    r = moec("calibrate", "demo-moe", "--recipe", recipe, "--samples", "2", "--seq-len", "128", "-o", calib)
    assert r.returncode == 0, r.stderr
    r = moec("pack", "demo-moe", calib, "-o", packed)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((packed / "moec.json").read_text())
    assert manifest["recipe"]["kv"]["codec"] == "toy-int8" and manifest["recipe"]["kv"]["clip"] == 1.0
    assert manifest["tensors"]["layers.0.moe.w1.q"]["codec"] == "toy-int8w"
    r = moec("eval", packed, "--mode", "both", "--max-windows", "1", "--seq-len", "256", "--baseline", "demo-moe",
             "--json", out)
    assert r.returncode == 0, r.stderr
    tf, dec = json.loads(out.read_text())
    # int8 weights and an int8 cache barely move a 2-layer-deep demo model: within 1% of the source
    assert abs(tf["delta_pct"]) < 1.0 and abs(dec["delta_pct"]) < 1.5, (tf, dec)
    assert dec["kv_codec"] == "toy-int8" and 8 < dec["kv_bits_32k"] < 9, dec

    # the static engine (CUDA-graph engine, here on the CPU) holds the registered block codec
    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, tokenize
    from moec.runtime.decode import evaluate_dec, make_cache
    from moec.runtime.kvtiered import build_codecs
    from moec.runtime.loader import kv_cache_factory, load_model
    from moec.runtime.perplexity import evaluate, make_windows

    model, info = load_model(packed)
    windows = make_windows(tokenize(load_tokenizer(packed), load_text("ptb", "test")), 160, 1)
    codecs = build_codecs(info["kv"], info["kv_tensors"], model.args)
    static = evaluate_dec(model, windows, lambda b, n: make_cache(model, b, n, info["kv"], codecs))
    dynamic = evaluate(model, windows, "dec", cache_factory=kv_cache_factory(info, model.args))
    assert abs(static["ppl"] / dynamic["ppl"] - 1) < 1e-4, (static["ppl"], dynamic["ppl"])
