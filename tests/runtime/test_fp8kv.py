"""The fp8 KV codec (moec/runtime/fp8kv.py, calibrate/fp8kv.py): codes are torch's e4m3 rounding of x / scale
(saturating at ±448), the scales are amax / 448 over every captured token, and a calibrated pack runs end to
end with the fp8 cache close to fp16."""

import torch

from moec.calibrate.fp8kv import AmaxObserver, fit_fp8
from moec.codecs.fp8kv import FP8KVConfig
from moec.runtime.config import ModelArgs
from moec.runtime.fp8kv import E4M3_MAX, FP8KVCodec, fp8_layer_codecs

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 max_seq_len=256)


def test_codes_are_e4m3_of_the_scaled_values_and_saturate():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 32, 32, generator=g) * 3
    x[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])
    c = FP8KVCodec(32, torch.tensor([0.01]), torch.tensor([0.02]))
    for kind, s in (("k", 0.01), ("v", 0.02)):
        f = c.encode(x, kind)
        assert f["codes"].dtype == torch.uint8 and f["codes"].shape == x.shape
        want = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        assert torch.equal(f["codes"], want.view(torch.uint8))
        y = c.decode(f, kind)
        assert torch.equal(y, want.float() * s)
        assert y[0, 0, 0, 0] == E4M3_MAX * s and y[0, 0, 0, 1] == -E4M3_MAX * s
        inside = (x / s).abs() < E4M3_MAX  # e4m3: 3 mantissa bits, relative error ≤ 2^-4 above the subnormals
        assert ((y - x).abs() <= 2**-4 * x.abs() + 2**-9 * s)[inside].all()


def test_scales_are_amax_over_every_token_and_resume():
    obs = AmaxObserver()
    g = torch.Generator().manual_seed(1)
    seen = {(i, k): 0.0 for i in range(2) for k in "kv"}
    for step in range(3):
        for i in range(2):
            for k in ("k", "v", "k_pre", "q"):
                t = torch.randn(2, 2, 8, 32, generator=g) * (step + 1)
                obs(i, k, t)
                if k in ("k", "v"):
                    seen[(i, k)] = max(seen[(i, k)], float(t.abs().max()))
    again = AmaxObserver()
    again.load_state_dict(obs.state_dict())
    tensors, report = fit_fp8(ARGS, FP8KVConfig(codec="fp8", window=0, sinks=0), again)
    for (i, k), amax in seen.items():
        assert torch.equal(tensors[f"kv.layers.{i}.{k}_scale"], torch.tensor([amax / E4M3_MAX]))
    assert report["layers"][0]["tokens"] == 3 * 2 * 8
    codecs = fp8_layer_codecs({}, tensors, ARGS)
    assert len(codecs) == 2 and codecs[1].scale["v"] == tensors["kv.layers.1.v_scale"].item()


def test_calibrated_fp8_cache_runs_close_to_fp16(tiny_moe_dir, tmp_path):
    """calibrate → pack → eval through the CLI on the tiny Mixtral: 8 KV bits and decode ppl within 1% of the
    fp16 cache's (fp8 e4m3 keeps 3 mantissa bits)."""
    import json

    from moec.cli.app import run

    env = {"MOEC_PROGRESS": "0"}
    assert run("calibrate", tiny_moe_dir, "--recipe", "kv-fp8", "--samples", "4", "--seq-len", "128", "--data",
               "ptb", "-o", tmp_path / "c", env=env).returncode == 0
    assert run("pack", tiny_moe_dir, tmp_path / "c", "-o", tmp_path / "p", env=env).returncode == 0
    r = run("eval", tmp_path / "p", "--mode", "dec", "--seq-len", "256", "--max-windows", "2", "--baseline",
            tiny_moe_dir, "--json", tmp_path / "e.json", env=env)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "e.json").read_text())[0]
    assert 7.9 < rec["kv_bits_32k"] <= 8.01
    assert abs(rec["delta_pct"]) < 1.0, rec
