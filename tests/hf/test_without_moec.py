"""No silent failure (issue 34): a packed directory opened by a process that has not imported moec is refused,
naming moec and the fix, instead of loading as a randomly initialised model; `import moec.hf` alone makes
`AutoModelForCausalLM.from_pretrained` load it, with moec's own logits. In a fresh interpreter, as a
pipeline, an evaluation harness or a notebook would open it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import parse_recipe
from moec.formats import checkpoint
from moec.runtime.config import ModelArgs
from moec.runtime.loader import load_model

ARGS = ModelArgs(arch="mixtral", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 max_seq_len=128, n_experts=4, top_k=2, expert_dim=64)
RECIPE = {"name": "rnd", "weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0,
                                      "gptq": False}]}
IDS = [[5, 17, 3, 88, 41, 9]]

# one fresh interpreter for both (one transformers import, seconds of CI): the first load runs before anything
# of moec is imported, as in a process that never imports it (checked: no moec module in sys.modules then)
SCRIPT = """
import sys, json, torch, transformers
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
    print("GENERATED", model.generate(torch.tensor({ids}), max_new_tokens=4).tolist())
except ValueError as e:
    print("REFUSED", str(e).splitlines()[0])
print("MOEC_IMPORTED", any(m == "moec" or m.startswith("moec.") for m in sys.modules))
import moec.hf
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    json.dump(model(torch.tensor({ids})).logits.tolist(), open(sys.argv[2], "w"))
"""


def _run(code: str, *argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-c", code.format(ids=IDS), *map(str, argv)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_packed_dir_without_moec_is_refused_and_with_moec_hf_loads(tmp_path):
    pack_random(ARGS, "tiny", parse_recipe(RECIPE), tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg[checkpoint.SOURCE_MODEL_TYPE] == "mixtral"

    r = _run(SCRIPT, tmp_path / "p", tmp_path / "logits.json")
    assert "GENERATED" not in r.stdout, r.stdout  # a random model, silently: what transformers did before
    refused = next((line for line in r.stdout.splitlines() if line.startswith("REFUSED")), "")
    assert "moec" in refused and "pip install moec" in refused and "import moec.hf" in refused, r.stdout + r.stderr
    assert "MOEC_IMPORTED False" in r.stdout, r.stdout
    assert r.returncode == 0, r.stderr  # then `import moec.hf` alone: transformers loads it
    model, _ = load_model(tmp_path / "p")
    with torch.no_grad():
        want = model(torch.tensor(IDS))
    torch.testing.assert_close(torch.tensor(json.loads((tmp_path / "logits.json").read_text())), want,
                               rtol=1e-5, atol=1e-5)
