"""Behaviour references: what every `kv-*` / `experts-*` recipe produces on demo-moe, recorded once.

For each recipe in `moec/recipes/` and `moec/recipes/ablations/` whose name starts with `kv-` or `experts-`, through
the CLI as a user runs it:
calibrate demo-moe (PTB train, 4 × 256 tokens, the recipe's seed), pack, and eval one PTB-test window of
512 tokens in `tf` and `dec` mode (fp32, CPU). Recorded: the sha256 of every packed tensor's bytes and
both perplexities. A refactor must keep the bytes identical and the perplexities within 1e-6 relative.

    python3 -m benchmarks.behaviour_ref record [--only NAME ...]   # writes benchmarks/results/behaviour_refs_cpu.json
    python3 -m benchmarks.behaviour_ref check [--only NAME ...]    # compares against it, exit 1 on a difference

Run with OMP_NUM_THREADS=1 (as CI does): fp32 reductions may change in the last bit with the thread count.
Bytes are compared only on the platform the references were recorded on (`platform()`: CPU model and
torch's CPU capability; other kernels, other last bits); elsewhere the perplexities are compared to 1e-3.
Tuned recipes are capped at TUNE_STEPS_CAP tuning steps to keep the full run affordable on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from moec.atomic import write_json
from moec.calibrate.recipe import recipe_files

ROOT = Path(__file__).resolve().parent.parent
REFS = ROOT / "benchmarks" / "results" / "behaviour_refs_cpu.json"
CALIB = ["--data", "ptb", "--split", "train", "--samples", "4", "--seq-len", "256"]
EVAL = ["--data", "ptb", "--split", "test", "--mode", "both", "--max-windows", "1", "--seq-len", "512"]
TUNE_STEPS_CAP = 10
PPL_RTOL = 1e-6
PPL_RTOL_OTHER_PLATFORM = 1e-3


def platform() -> str:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?") if Path("/proc/cpuinfo").is_file() else "?"
    return f"{model} / {torch.backends.cpu.get_cpu_capability()}"


def recipes() -> list[Path]:
    """The shipped recipes and their ablations (moec/recipes/ablations/), in name order."""
    return [p for p in recipe_files(ROOT / "moec" / "recipes") if p.stem.startswith(("kv-", "experts-"))]


def recipe_file(name: str) -> Path:
    """moec/recipes/NAME.yaml, or moec/recipes/ablations/NAME.yaml for an ablation."""
    return next(p for p in recipes() if p.stem == name)


def _moec(*args: str | Path) -> subprocess.CompletedProcess:
    """`moec ARGS` in this process from the repository root (moec.cli.app.run: the `moec` command's parsing,
    work and exit code, output captured): three commands a recipe would otherwise pay torch's and
    transformers' imports three times (seconds each on two cores)."""
    from moec.cli.app import run

    with contextlib.chdir(ROOT):
        return run(*args, env={"MOEC_PROGRESS": "0", "COLUMNS": "200"})


def tensor_hashes(packed: Path) -> dict[str, str]:
    """sha256 of each stored tensor's raw bytes (dtype and shape included), over every shard."""
    import torch
    from safetensors import safe_open

    out = {}
    for shard in sorted(packed.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
                h.update(t.reshape(-1).view(dtype=torch.uint8).numpy().tobytes())
                out[name] = h.hexdigest()
    return dict(sorted(out.items()))


def run_one(recipe: Path, tmp: Path) -> dict:
    r = yaml.safe_load(recipe.read_text())
    cal = r.get("calibration") or {}
    if cal.get("tune_steps", 0) > TUNE_STEPS_CAP:
        cal["tune_steps"] = TUNE_STEPS_CAP
        r["calibration"] = cal
    used = tmp / f"{recipe.stem}.yaml"
    used.write_text(yaml.safe_dump(r))
    t0 = time.time()
    p = _moec("calibrate", "demo-moe", "--recipe", used, *CALIB, "-o", tmp / "calib")
    if p.returncode != 0:
        return {"applies": False, "why": (p.stderr.strip().splitlines() or ["?"])[-1]}
    p = _moec("pack", "demo-moe", tmp / "calib", "-o", tmp / "packed")
    if p.returncode != 0:
        raise RuntimeError(f"{recipe.stem}: pack failed: {p.stderr}")
    p = _moec("eval", tmp / "packed", *EVAL, "--json", tmp / "eval.json")
    if p.returncode != 0:
        raise RuntimeError(f"{recipe.stem}: eval failed: {p.stderr}")
    ppl = {rec["mode"]: rec["ppl"] for rec in json.loads((tmp / "eval.json").read_text())}
    return {"applies": True, "ppl_tf": ppl["tf"], "ppl_dec": ppl["dec"], "tensors": tensor_hashes(tmp / "packed"),
            "seconds": round(time.time() - t0, 1)}


def compare(name: str, ref: dict, got: dict, same_platform: bool = True) -> list[str]:
    if ref["applies"] != got["applies"]:
        return [f"{name}: applies {ref['applies']} → {got['applies']} ({got.get('why', '')})"]
    if not ref["applies"]:
        return []
    rtol = PPL_RTOL if same_platform else PPL_RTOL_OTHER_PLATFORM
    bad = [f"{name}: {k} {ref[k]!r} → {got[k]!r}" for k in ("ppl_tf", "ppl_dec")
           if abs(got[k] - ref[k]) > rtol * abs(ref[k])]
    if not same_platform:
        return bad
    rt, gt = ref["tensors"], got["tensors"]
    bad += [f"{name}: tensor {n} missing" for n in rt if n not in gt]
    bad += [f"{name}: tensor {n} is new" for n in gt if n not in rt]
    bad += [f"{name}: tensor {n} bytes differ" for n in rt if n in gt and rt[n] != gt[n]]
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["record", "check"])
    ap.add_argument("--only", nargs="*", help="recipe names (default: every kv-*/experts-* recipe)")
    a = ap.parse_args()
    todo = [p for p in recipes() if not a.only or p.stem in a.only]
    unknown = sorted(set(a.only or ()) - {p.stem for p in todo})
    if unknown:
        print(f"behaviour_ref: no kv-*/experts-* recipe named {', '.join(unknown)} under moec/recipes/",
              file=sys.stderr)
        return 2
    refs = json.loads(REFS.read_text()) if REFS.exists() else {"protocol": {}, "recipes": {}}
    same_platform = refs["protocol"].get("platform") == platform()
    if a.action == "check" and not same_platform:
        print(f"note: the references were recorded on {refs['protocol'].get('platform')}, this is {platform()}: "
              f"perplexities compared to {PPL_RTOL_OTHER_PLATFORM:g}, bytes not compared", flush=True)
    failures = []
    for p in todo:
        with tempfile.TemporaryDirectory() as d:
            got = run_one(p, Path(d))
        print(f"{p.stem}: " + (f"ppl_tf {got['ppl_tf']:.6f} ppl_dec {got['ppl_dec']:.6f}, "
                               f"{len(got['tensors'])} tensors, {got['seconds']} s" if got["applies"]
                               else f"does not apply ({got['why']})"), flush=True)
        if a.action == "record":
            refs["recipes"][p.stem] = got
        elif p.stem not in refs["recipes"]:
            failures.append(f"{p.stem}: no reference recorded")
        else:
            failures += compare(p.stem, refs["recipes"][p.stem], got, same_platform)
    if a.action == "record":
        refs["protocol"] = {"model": "demo-moe", "calibrate": " ".join(CALIB), "eval": " ".join(EVAL),
                            "tune_steps_cap": TUNE_STEPS_CAP, "ppl_rtol": PPL_RTOL,
                            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "platform": platform(),
                            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                     cwd=ROOT).stdout.strip()}
        write_json(REFS, refs)
        print(f"wrote {REFS}")
        return 0
    for f in failures:
        print("DIFF", f)
    print(f"{len(todo)} recipes checked, {len(failures)} differences")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
