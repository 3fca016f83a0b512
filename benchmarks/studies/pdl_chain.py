"""What programmatic dependent launch (PDL) would buy the decode step (issues 32, 35, 36), prepared 2026-12-06.

A batch-1 step is a chain of a few hundred small kernels in one CUDA graph, each waiting for the previous one to
finish before its first instruction runs: GLM-4.5-Air's "rest" and DeepSeek-V2-Lite's (1.3 ms of 4.2) are mostly
that gap. Hopper can start a kernel before its predecessor ends (`launch_pdl=True` at launch; the kernel calls
`gdc_wait()` before it reads what the predecessor wrote, the predecessor `gdc_launch_dependents()` to let it be
scheduled early; both from `triton.language.extra.cuda`, unused in moec so far). A decode GEMV's weights do not
depend on the previous kernel, so it can also load its weight tile *before* the wait and overlap that DRAM
latency with the predecessor's tail.

The chain here: L GEMVs y_{i+1} = W_i y_i (bf16 weights [D, D], fp32 accumulate, the activation in bf16),
captured in one CUDA graph, in three modes, each checked against torch's chain:
    plain   ordinary launches (what moec does);
    pdl     launch_pdl, gdc_wait at the top, gdc_launch_dependents right after it;
    early   as pdl, with the weight tile loaded before gdc_wait.
At D 1024 (2 MiB a kernel: launch-bound, like the step's small kernels) and 4096 (32 MiB: bandwidth-bound, like
an attention projection). The answer sought: µs saved per kernel boundary, and whether it holds in a graph.

    python3 -m benchmarks.studies.pdl_chain --out pdl_chain_h100.json       (GPU, ~30 s)
    python3 -m benchmarks.studies.pdl_chain --compile                      (CPU: builds all three for sm_90)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MODES = {"plain": (False, False), "pdl": (True, False), "early": (True, True)}
BLOCK_O = 16  # output rows a program: D / 16 programs, 64 to 256 here (one wave or two on 132 SMs)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, D, PDL: tl.constexpr, EARLY: tl.constexpr, BO: tl.constexpr,
                 BK: tl.constexpr):
    """y[rows] = W[rows, :] · x for BO rows a program (fp32 accumulate, y in x's dtype); K in chunks of BK."""
    pid = tl.program_id(0)
    rows = pid * BO + tl.arange(0, BO)
    ks = tl.arange(0, BK)
    if EARLY:  # the weights do not depend on the previous kernel: their first chunk is in flight during the wait
        w_first = tl.load(w_ptr + rows[:, None] * D + ks[None, :])
    if PDL:
        gdc_wait()  # the previous kernel's y (this x) is complete and visible from here on
        gdc_launch_dependents()  # the next kernel may start its prologue (its own weight loads)
    if not EARLY:
        w_first = tl.load(w_ptr + rows[:, None] * D + ks[None, :])
    acc = tl.sum(w_first.to(tl.float32) * tl.load(x_ptr + ks).to(tl.float32)[None, :], axis=1)
    for k0 in range(BK, D, BK):
        w = tl.load(w_ptr + rows[:, None] * D + (k0 + ks)[None, :])
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + k0 + ks).to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


def chain(xs: list[torch.Tensor], ws: list[torch.Tensor], mode: str) -> None:
    """xs[i + 1] = ws[i] · xs[i] for every layer, launched in `mode`."""
    pdl, early = MODES[mode]
    D = ws[0].shape[1]
    for i, w in enumerate(ws):
        _gemv_kernel[(D // BLOCK_O,)](xs[i], w, xs[i + 1], D, PDL=pdl, EARLY=early, BO=BLOCK_O, BK=256,
                                      num_warps=4, launch_pdl=pdl)


def compile_all() -> int:
    """Build the three modes for sm_90 (no GPU): registers and whether griddepcontrol made it into the PTX."""
    from moec.kernels import aot

    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "D": "i32"}
    for mode, (pdl, early) in MODES.items():
        k = aot.compile_cuda(_gemv_kernel, types, {"PDL": pdl, "EARLY": early, "BO": BLOCK_O, "BK": 256}, 4)
        ptx = k.asm["ptx"]
        print(mode, aot.resources(k.asm["cubin"]), "griddepcontrol.wait" in ptx,
              "griddepcontrol.launch_dependents" in ptx)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compile", action="store_true", help="CPU: compile the three modes for sm_90 and stop")
    a = ap.parse_args()
    if a.compile:
        return compile_all()
    if not torch.cuda.is_available() or a.out is None:
        print("pdl_chain: needs a CUDA GPU and --out (or --compile on the CPU)", file=sys.stderr)
        return 2
    from benchmarks.benchutil import graph_times
    from moec.atomic import write_json
    from moec.provenance import environment

    t0 = time.time()
    res = {"study": "pdl_chain", "device": torch.cuda.get_device_name(), "environment": environment("cuda"),
           "date": time.strftime("%Y-%m-%d"), "records": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for D, L in ((1024, 64), (4096, 32)):
        ws = [(torch.randn(D, D, device="cuda", generator=gen) / D**0.5).bfloat16() for _ in range(L)]
        x0 = torch.randn(D, device="cuda", generator=gen).bfloat16()
        want = [x0]
        for w in ws:  # torch's chain, rounded to bf16 per layer as the kernel's store is
            want.append((w.float() @ want[-1].float()).bfloat16())
        base = None
        for mode in MODES:
            xs = [x0.clone()] + [torch.zeros(D, device="cuda", dtype=torch.bfloat16) for _ in ws]
            rec = dict(D=D, layers=L, mode=mode, bytes_per_layer=D * D * 2)
            try:
                chain(xs, ws, mode)
                torch.cuda.synchronize()
                rec["max_rel_err"] = ((xs[-1].float() - want[-1].float()).abs().max()
                                      / want[-1].float().abs().max()).item()
                ms = statistics.median(graph_times(lambda xs=xs, ws=ws, mode=mode: chain(xs, ws, mode), 20))
                rec["us_per_layer"] = ms * 1e3 / L
                rec["gbps"] = D * D * 2 * L / (ms * 1e-3) / 1e9
                base = rec["us_per_layer"] if mode == "plain" else base
                if base is not None:
                    rec["saved_us_per_layer"] = base - rec["us_per_layer"]
            except Exception as e:  # e.g. a driver or graph capture without PDL support
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(json.dumps(rec), flush=True)
            res["records"].append(rec)
        ws.clear()
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
