"""`moec generate`, `moec pack --random` and `moec eval --latency`, as a user runs them (CPU)."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture
def moec(capsys, monkeypatch):
    """The CLI entry point in-process (a subprocess per call costs ~15 s of imports on a busy CPU)."""
    from moec.cli.app import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["moec", *map(str, args)])
        with pytest.raises(SystemExit) as e:
            main()
        out = capsys.readouterr()
        return SimpleNamespace(returncode=e.value.code, stdout=out.out, stderr=out.err)

    return run


def test_generate_streams_demo_moe_greedy(moec):
    r = moec("generate", "demo-moe", "--prompt", "the company said", "-n", "12", "--no-stop-at-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the company said") and len(r.stdout) > len("the company said") + 10
    assert "12 tokens" in r.stderr
    from moec.calibrate.sources import load_tokenizer, resolve_model
    from moec.runtime.generate import generate
    from moec.runtime.loader import load_model

    d = resolve_model("demo-moe")
    tok = load_tokenizer(d)
    ids = generate(load_model(d)[0], tok("the company said", add_special_tokens=False)["input_ids"], 12)
    assert r.stdout.rstrip("\n") == "the company said" + tok.decode(ids, skip_special_tokens=True)


def test_bad_input_is_one_clean_line(moec, tmp_path):
    for args, needle in ((("generate", "demo-moe", "--prompt", "x", "-n", "0"), "--max-new-tokens"),
                         (("generate", "demo-moe", "--prompt", "x", "-n", "5000"), "maximum of 4096"),
                         (("pack", "--random", "nope", "--recipe", "moec/recipes/fp16.yaml", "-o", tmp_path / "p"),
                          "mixtral-8x7b"),
                         (("pack", "--random", "mixtral-8x7b", "-o", tmp_path / "p"), "--recipe"),
                         (("eval", "--latency", "--random", "mixtral-8x7b"), "CUDA" if not torch.cuda.is_available()
                          else "")):
        r = moec(*args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not (tmp_path / "p").exists()


def test_pack_random_roundtrip_tiny(tmp_path):
    """pack_random at a tiny shape: the loader runs it (2-bit experts, 4-bit attention, nuq-outlier KV)."""
    from moec.calibrate.pack import pack_random
    from moec.calibrate.recipe import load_recipe
    from moec.runtime.config import ModelArgs
    from moec.runtime.generate import runtime_generate
    from moec.runtime.loader import load_model

    args = ModelArgs(arch="mixtral", vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=1024, n_experts=4, top_k=2, expert_dim=96)
    m = pack_random(args, "tiny", load_recipe("moec/recipes/latency-hls2-nuq2-attn4.yaml"), tmp_path / "rp")
    manifest = json.loads((tmp_path / "rp" / "moec.json").read_text())
    assert manifest["recipe"]["kv"]["codec"] == "nuq-outlier" and manifest["source"]["model"] == "random:tiny"
    # experts (295k params): 2-bit codes + a per-row int8 codebook and fp16 scale, 2.42 bits here;
    # attention (197k): 4-bit codes + fp16 scale and zero per 128 inputs, 4.25 bits: 3.15 over both
    assert 3.1 < m["effective_bits"]["q_bits"] < 3.2
    model, info = load_model(tmp_path / "rp")
    assert model.layers[0].moe.codec is not None and type(model.layers[0].attn.wq).__name__ == "QLinear"
    out = runtime_generate(model, info, [1, 2, 3], 200)  # crosses several 32-token history blocks
    assert len(out) == 200 and all(0 <= t < 300 for t in out)
