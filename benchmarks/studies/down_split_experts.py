"""The 2-bit MoE decode at batch 1 with the down GEMV's slots split over programs (moe_decode's split_experts),
one layer of each MoE shape the engine times, on the GPU.

    python3 -m benchmarks.studies.down_split_experts --out X.json [--layers 8] [--budget 150]

Why: at batch 1 the down launch has one program a (token, 16 output rows): DeepSeek-V2-Lite's 2048 outputs and
Qwen3's make 128 programs on 132 SMs, each walking all top-k experts (V2-Lite's `_down_kernel` took 0.42 ms a step
at 32k against 0.20 for gate/up, twice the bytes; H100, 2026-12-06). Each record is the whole moe_decode (hls2 on the
prmt path; `--kinds hls2,bf16` adds the dense path) under a CUDA graph over `--layers` layers of separate weights
(more bytes than L2), ms per layer, for
split_experts in the divisors of top-k (`config`), block_o_down 8 with the slots unsplit, input tiles of
512 / 1024 (block_k_down) where they are shorter than I, and the default (`config: "default"`, what the engine
runs); `--tree` labels the records (the same script run from two trees compares their kernels); `gbps` counts
the active experts' bytes (gate, up, down). Each config is checked on layer 0 against moe_decode_ref (max rel.
error ≤ 5e-3, the prmt path's bound).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bench_moe_kernel import copy_bandwidth, graph_time, make_weight, nbytes, rel_err
from moec.cli.common import base_record, write_json_atomic
from moec.kernels.moe_decode import moe_decode, moe_decode_ref

# name: (experts, top-k, hidden, expert intermediate)
SHAPES = {"deepseek-v2-lite": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768),
          "glm-4.5-air": (128, 8, 4096, 1408), "gpt-oss-120b": (128, 4, 2880, 2880),
          "mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v3": (256, 8, 7168, 2048)}


def time_layers(x, ids, wts, ws, cfg) -> float:
    """ms per layer of moe_decode with cfg over the layers' separate weights, replayed from a CUDA graph."""
    return graph_time(lambda: [moe_decode(x, ids, wts, *w, **cfg) for w in ws]) / len(ws)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; shapes left when it runs out are skipped")
    ap.add_argument("--tree", default="", help="a label for the moec/ tree measured (e.g. base / patched)")
    ap.add_argument("--kinds", default="hls2", help="comma-separated weight kinds (hls2, bf16: the dense path)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("down_split_experts: needs a CUDA GPU")
    t0, records = time.time(), []
    copy = copy_bandwidth()
    for kind, (name, (E, A, D, I)) in ((k, s) for k in a.kinds.split(",") for s in SHAPES.items()):
        if time.time() - t0 > a.budget:
            print(f"{name} {kind}: skipped (budget)")
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        per_layer = E * I * D * 3 * (2 if kind == "bf16" else 1 / 4)  # V3's layers: 2.8 GB at 2 bits, 22.5 in bf16
        layers = max(1, min(a.layers, int((24 << 30) // per_layer)))
        ws = [(make_weight(kind, E, I, D, g), make_weight(kind, E, I, D, g), make_weight(kind, E, D, I, g))
              for _ in range(layers)]
        x = torch.randn(1, D, device="cuda", generator=g, dtype=torch.bfloat16)
        ids = torch.randperm(E, device="cuda", generator=g)[:A][None].to(torch.int32)
        wts = torch.softmax(torch.randn(1, A, device="cuda", generator=g), -1)
        active = sum(nbytes(w, A) for w in ws[0])
        # the reference over the active experts only (its int64 codes of all of V3's 256 would need 28 GB)
        sub = [w._replace(data=w.data[ids[0].long()], a=None if w.a is None else w.a[ids[0].long()],
                          b=None if w.b is None else w.b[ids[0].long()]) for w in ws[0]]
        slots = torch.arange(A, device="cuda", dtype=torch.int32)[None]
        want = moe_decode_ref(x.float(), slots, wts, *sub)
        sub = None
        configs = [("default", {})] + [(f"split_experts={s}", {"split_experts": s})
                                       for s in range(1, A + 1) if A % s == 0]
        configs.append(("block_o_down=8,split_experts=1", {"block_o_down": 8, "split_experts": 1}))
        # shorter input tiles where I is no power of two (1408 in a 2048 tile: 31% of lanes masked; 2880 in two: 30%)
        configs += [(f"block_k_down={k}", {"block_k_down": k}) for k in (512, 1024) if k < I]
        for label, cfg in configs:
            rec = base_record("moe-down-split-experts", "cuda") | {
                "shape": name, "kind": kind, "E": E, "top_k": A, "D": D, "I": I, "batch": 1, "layers": layers,
                "config": label, "tree": a.tree}
            try:
                err = rel_err(moe_decode(x, ids, wts, *ws[0], **cfg), want)
                ms = time_layers(x, ids, wts, ws, cfg)
                gbps = active / ms / 1e6
                rec |= {"ms": ms, "gbps": gbps, "pct_of_copy": 100 * gbps / copy, "max_rel_err": err,
                        "ok": err <= 5e-3}
            except Exception as ex:  # a config that fails to compile is a result too
                rec |= {"ok": False, "error": f"{type(ex).__name__}: {str(ex)[:200]}"}
            records.append(rec)
            write_json_atomic(a.out, records)
            res = f"{rec['ms'] * 1e3:7.1f} us  {rec['pct_of_copy']:5.1f}% of copy" if "ms" in rec else rec["error"]
            print(f"{name:18s} {kind:5s} {label:32s} {res}", flush=True)
        ws = want = None  # this shape's weights freed before the next one's
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
