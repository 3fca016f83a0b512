"""Launch-config sweep of the fused 2-bit MoE decode kernels (issue 16 item 3), one phase at a time.

    python3 -m benchmarks.sweep_moe_decode --out X.json [--budget 240] [--kind hls2|bf16|vq2|vq3|tcq2|tcq3|mxfp4]
        [--batches 1,16] [--shapes mixtral-8x7b,qwen3-30b-a3b,gpt-oss-120b,...] [--write-config DIR]

For each shape (Mixtral-8x7B, Qwen3-30B-A3B) and batch (1, 16): the whole `moe_decode` (hls2, prmt path)
timed under a CUDA graph over L layers with separate weights (more bytes than L2, as bench_moe_kernel.py),
first varying the gate/up launch (block_o, block_k, num_warps, num_stages) with the down launch at its
default, then the down launch (block_o_down, block_k_down, num_warps_down, num_stages_down, split) with the
best gate/up. Every config is checked against the torch reference on layer 0 (max rel. error ≤ 5e-3, the
fp16x2 prmt path's bound); a config that fails to compile or misses is recorded with its error. Records:
`phase`, `config`, `ms` (per layer), `gbps`, `pct_of_copy`; the JSON is rewritten after every record.
--write-config DIR: the config best on most (shape, batch) becomes this device's moe_decode launch config
in DIR/<device>.json (moec/kernels/launch_config.py; MOEC_KERNEL_CONFIG_DIR=DIR uses it).
--kind mxfp4: gpt-oss's experts as shipped (e2m1 codes, a power-of-two scale a 32-input block, held as the runtime
holds them: runtime/fp4.py), on the fp16x2 kernels (kernels/fp4_h2.py; MOEC_FP4H=0: the fp32 int32-word GEMV,
dequant.gemv_fp4_words), which run the `fp4` launch slot (the `legacy` values until this sweep writes it).
--dry: toy shapes on the CPU (run with TRITON_INTERPRET=1), to check the script, not to time.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time
from pathlib import Path

import torch

from benchmarks.bench_moe_kernel import DEV, SHAPES, copy_bandwidth, graph_time, make_weight, nbytes, rel_err
from moec.cli.common import base_record, write_json_atomic
from moec.kernels import launch_config
from moec.kernels.dequant import MODE_FP4, QWeight
from moec.kernels.fp4_h2 import use_fp4h
from moec.kernels.moe_decode import DECODE_CONFIG, FP4_CONFIG, LEGACY_CONFIG, moe_decode, moe_decode_ref
from moec.runtime import fp4

GATE_UP = [dict(block_o=bo, block_k=bk, num_warps=nw, num_stages=st)
           for bo, bk, nw, st in itertools.product((8, 16, 32), (1024, 2048, 4096), (4, 8), (1, 3))]
DOWN = [dict(block_o_down=bo, block_k_down=bk, num_warps_down=nw, num_stages_down=st, split=sp)
        for bo, bk, nw, st, sp in itertools.product((8, 16, 32), (1024, 2048), (4, 8), (1, 3), (None, 1))]
# --kind bf16 (the dense path: 2 bytes per weight, no lookup; tiles of fewer inputs)
GATE_UP_DENSE = [dict(block_o=bo, block_k=bk, num_warps=nw) for bo, bk, nw in
                 itertools.product((8, 16, 32), (256, 512, 1024), (4, 8))]
DOWN_DENSE = [dict(block_o_down=bo, block_k_down=bk, num_warps_down=nw, split=sp) for bo, bk, nw, sp in
              itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (None, 1))]
# --kind vq2 / vq3 (vector codebooks: word-chunk codes, a codebook gather per code; bench_moe_kernel.VQ_DIM) and
# tcq2 / tcq3 (trellis codes, MODE_TCQ: the same grid; they run the legacy config by default)
GATE_UP_VQ = [dict(block_o=bo, block_k=bk, num_warps=nw) for bo, bk, nw in
              itertools.product((8, 16, 32), (512, 1024, 2048), (4, 8))]
DOWN_VQ = [dict(block_o_down=bo, block_k_down=bk, num_warps_down=nw) for bo, bk, nw in
           itertools.product((8, 16, 32), (512, 1024, 2048), (4, 8))]
# --kind mxfp4 (the word GEMV: 32 inputs a chunk; the down grid's top-k slots split over programs too)
GATE_UP_FP4 = [dict(block_o=bo, block_k=bk, num_warps=nw) for bo, bk, nw in
               itertools.product((8, 16, 32), (256, 512, 1024), (4, 8))]
DOWN_FP4 = [dict(block_o_down=bo, block_k_down=bk, num_warps_down=nw, split_experts=se) for bo, bk, nw, se in
            itertools.product((8, 16, 32), (512, 1024), (4, 8), (None, 1, 4))]
# (E, A, D, I) beyond bench_moe_kernel's two: gpt-oss-120b's experts (128 of 2880 x 2880, top-4), GLM-4.5-Air's
# routed experts (128 of 4096 x 1408, top-8), DeepSeek-V2-Lite's (64 of 2048 x 1408, top-6)
MORE_SHAPES = {"gpt-oss-120b": (128, 4, 2880, 2880), "glm-4.5-air": (128, 8, 4096, 1408),
               "deepseek-v2-lite": (64, 6, 2048, 1408)}


def fp4_weight(E: int, O: int, n_in: int, gen) -> QWeight:
    """Random mxfp4 experts [E, O, n_in] as the runtime holds them (every code, one power-of-two scale a block)."""
    held = fp4.hold_mxfp4(4, fp4.random_mxfp4(4, (E, O, n_in), 32, DEV, gen))
    return QWeight(MODE_FP4, 4, n_in, held["codes"], held["scale"])


def time_layers(x, ids, wts, ws, cfg) -> float:
    """ms per layer of moe_decode with cfg over the layers' separate weights, replayed from a CUDA graph."""
    return graph_time(lambda: [moe_decode(x, ids, wts, *w, **cfg) for w in ws]) / len(ws)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds, shared equally by the 4 (shape, batch)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kind", default="hls2", choices=("hls2", "bf16", "vq2", "vq3", "tcq2", "tcq3", "mxfp4"))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--shapes", help="comma-separated, of " + ", ".join([*SHAPES, *MORE_SHAPES]) + " (default: "
                    + ", ".join(SHAPES) + ")")
    ap.add_argument("--dry", action="store_true", help="toy shapes on the CPU (bench_moe_kernel's --dry)")
    ap.add_argument("--write-config", type=Path, help="write the winner into DIR/<device>.json")
    a = ap.parse_args()
    if a.write_config and a.kind.startswith("tcq"):
        raise SystemExit(f"--write-config: {a.kind} runs the legacy config; it has no config slot of its own yet")
    grids = {"hls2": (("gate_up", GATE_UP), ("down", DOWN)), "bf16": (("gate_up", GATE_UP_DENSE), ("down", DOWN_DENSE)),
             "mxfp4": (("gate_up", GATE_UP_FP4), ("down", DOWN_FP4))}
    grids = grids.get(a.kind, (("gate_up", GATE_UP_VQ), ("down", DOWN_VQ)))
    known = SHAPES if a.dry else {**SHAPES, **MORE_SHAPES}
    names = a.shapes.split(",") if a.shapes and not a.dry else list(SHAPES)
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    shapes = {n: known[n] for n in names}
    batches = [int(b) for b in a.batches.split(",")]
    slots = len(shapes) * len(batches)
    weight = fp4_weight if a.kind == "mxfp4" else functools.partial(make_weight, a.kind)
    t0 = time.time()
    bw = copy_bandwidth()
    g = torch.Generator(device=DEV).manual_seed(0)
    records = []
    for shape, (E, A, D, I) in shapes.items():
        L = a.layers
        ws = [tuple(weight(E, o, n, g) for o, n in ((I, D), (I, D), (D, I))) for _ in range(L)]
        for N in batches:
            x = torch.randn(N, D, device=DEV, dtype=torch.bfloat16, generator=g)
            ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:A] for _ in range(N)])
            wts = torch.softmax(torch.randn(N, A, device=DEV, generator=g), -1)
            n_active = ids.unique().numel()
            act = sum(nbytes(w, n_active) for w in ws[0])
            ref = moe_decode_ref(x, ids, wts, *ws[0])
            # mxfp4: the fp16x2 kernels (fp4_h2.py) where the GPU has them, unless MOEC_FP4H=0 (the fp32 word path)
            path = ("fp4h" if use_fp4h(ws[0][0]) else "words") if a.kind == "mxfp4" else None
            best: dict = {}
            t_slot = time.time()  # each (shape, batch) gets an equal share of the budget
            for phase, grid in grids:
                times = []
                for cfg in grid:
                    if time.time() - t_slot > a.budget / slots or time.time() - t0 > a.budget:
                        break
                    full = {**best, **cfg}
                    rec = base_record("moec-moe-decode-sweep", DEV) | dict(
                        shape=shape, batch=N, kind=a.kind, phase=phase, config=cfg, bytes_per_step=act,
                        copy_gbps=bw, path=path)
                    try:
                        err = rel_err(moe_decode(x, ids, wts, *ws[0], **full), ref)
                        rec["max_rel_err_vs_ref"] = err
                        if err > 5e-3:
                            raise AssertionError(f"max rel err {err:.2e} > 5e-3")
                        ms = time_layers(x, ids, wts, ws, full)
                        rec |= dict(ms=ms, gbps=act / ms / 1e6, pct_of_copy=100 * act / ms / 1e6 / bw)
                        times.append((ms, cfg))
                    except Exception as ex:  # a config that does not compile or fit: recorded, the sweep goes on
                        rec["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                    records.append(rec)
                    write_json_atomic(a.out, records)
                    print(shape, N, phase, cfg, f"{rec.get('ms', float('nan')):.4f} ms",
                          f"{rec.get('pct_of_copy', 0):.1f}%", rec.get("error", ""), flush=True)
                if times:
                    ms, cfg = min(times, key=lambda t: t[0])
                    best.update(cfg)
                    print("best", shape, N, phase, cfg, f"{ms:.4f} ms", flush=True)
            records.append(base_record("moec-moe-decode-sweep", DEV) | dict(
                shape=shape, batch=N, kind=a.kind, phase="best", config=best,
                default=DECODE_CONFIG if a.kind == "hls2" else FP4_CONFIG if a.kind == "mxfp4" else LEGACY_CONFIG))
            write_json_atomic(a.out, records)
        ws.clear()
        torch.cuda.empty_cache()
    if a.write_config:
        bests = [tuple(sorted(r["config"].items())) for r in records if r.get("phase") == "best" and r["config"]]
        if bests:
            name = {"hls2": "prmt", "bf16": "dense", "mxfp4": "fp4"}.get(a.kind, "vq")
            path, dropped = launch_config.write_overrides(
                a.write_config, torch.cuda.get_device_name(), "moe_decode", name, dict(max(bests, key=bests.count)))
            print("wrote", path, "(left out:", dropped, ")", flush=True)


if __name__ == "__main__":
    main()
