"""The Gluon 2-bit hls MoE decode kernels (moec/kernels/gluon_moe_decode.py) against the `tl` prmt kernels, H200/H100.

    python3 -m benchmarks.bench_gluon_moe --out benchmarks/results/gluon_moe_h100.json          (~3 min cold)
    python3 -m benchmarks.bench_gluon_moe --out X.json --quick    (the shipped launch settings only)

Per shape (Mixtral-8x7B: 8 experts, top-2, 4096 -> 14336; Qwen3-30B-A3B: 128 experts, top-8, 2048 -> 768) and
decode batch (1, 4): first the check — both paths against the fp32 torch reference on layer 0 (`max_rel_err`
= max |err| / max |ref|) — then the times: each call runs L layers with their own weights (more bytes than the
L2), captured in one CUDA graph and replayed; per layer, median of 50 replays. Records: the whole MoE (both
paths; `tl` as the runtime launches it, prmt_pairs included), and each Gluon kernel alone over a sweep of its
launch settings (gate/up: rows per program BM, warps splitting the inputs KW, row-major or tiled codes; down: BM,
KW, programs splitting the inputs SPLIT, codes likewise). Bytes: the codes and tables of the experts a step
reads; `pct_of_copy` = bytes / time against a device-to-device copy (read + write) measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.benchutil import copy_bandwidth, graph_times, recorder
from moec.atomic import write_json
from moec.kernels import gluon_moe_decode as gmd
from moec.kernels.dequant import MODE_LUT, QWeight
from moec.kernels.moe_decode import moe_decode, moe_decode_ref
from moec.provenance import environment

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336, 4), "qwen3-30b-a3b": (128, 8, 2048, 768, 16)}  # E, A, D, I, layers
# gate/up (BM, KW, tiled codes); down (BM, KW, SPLIT, tiled). A cp.async pipeline of 3-6 stages and loops
# without the one-chunk prefetch were measured no faster (results/gluon_moe_variants_h100.json, 2026-12-06, the
# sweep before their removal) and removed from the kernels; so were two chunks of codes in flight and a cap of 96
# registers per thread (5 programs per SM) on the gate/up (results/gluon_moe_pf_h100.json, H100, 2026-12-06: the
# best such row 35.8 against 34.5 µs for Mixtral at batch 1; benchmarks/studies/gluon_moe_pf2.patch).
GATE_UP = [(32, 4, False), (16, 4, False), (32, 4, True), (16, 4, True), (32, 2, True), (64, 4, True), (32, 8, True)]
DOWN = {"mixtral-8x7b": [(16, 8, 1, False), (16, 8, 2, False), (16, 8, 1, True), (16, 8, 2, True), (32, 8, 2, True),
                         (16, 4, 2, True), (32, 4, 1, True)],
        "qwen3-30b-a3b": [(16, 4, 1, False), (16, 4, 1, True), (16, 2, 1, True), (32, 4, 1, True), (16, 2, 2, True)]}


def hls2(E: int, O: int, n_in: int, gen) -> QWeight:
    codes = torch.randint(0, 256, (E, O, n_in // 4), dtype=torch.uint8, device="cuda", generator=gen)
    lut = (torch.randn(E, O, 1, 4, device="cuda", generator=gen).sort(-1).values * 0.02).half()
    return QWeight(MODE_LUT, 2, n_in, codes, lut)


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def per_layer_ms(fn, L: int) -> float:
    return statistics.median(graph_times(fn, 50)) / L


def bench_case(record, copy: float, quick: bool, shape: str, A: int, layers: list, N: int, gen) -> None:
    """One shape at decode batch N: the check, the whole MoE on both paths, the Gluon kernels' sweeps."""
    E, D, I, L = layers[0][0].data.shape[0], layers[0][0].n_in, layers[0][0].data.shape[1], len(layers)
    x = (torch.randn(N, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:A] for _ in range(N)]).int()
    wts = torch.softmax(torch.randn(N, A, device="cuda", generator=gen), -1)
    w1, w3, w2 = layers[0]
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    tiles = [tuple(gmd.tile_codes(w.data) for w in lw) for lw in layers]  # the TILED layout's copies
    bytes_gu = N * A * 2 * I * (D // 4 + 8)
    bytes_dn = N * A * D * (I // 4 + 8)
    base = dict(shape=shape, batch=N, layers=L)

    def pct(nbytes: int, ms: float) -> float:
        return 100 * nbytes / (ms * 1e-3) / (copy * 1e9)

    def run_tl():
        for a, b, c in layers:
            moe_decode(x, ids, wts, a, b, c)

    def run_gluon():
        for a, b, c in layers:
            gmd.gluon_moe_decode(x, ids, wts, a, b, c, A)

    for path, fn, got in (("tl", run_tl, moe_decode(x, ids, wts, w1, w3, w2)),
                          ("gluon", run_gluon, gmd.gluon_moe_decode(x, ids, wts, w1, w3, w2, A))):
        ms = per_layer_ms(fn, L)
        record(**base, kernel="moe", path=path, ms=ms, max_rel_err=rel_err(got, want),
               pct_of_copy=pct(bytes_gu + bytes_dn, ms))
    hs = [torch.empty(N * A, I, dtype=torch.float16, device="cuda") for _ in range(L)]
    for bm, kw, tl in GATE_UP[:1] if quick else GATE_UP:
        def gu(bm=bm, kw=kw, tl=tl):
            for (a, b, _), h, t in zip(layers, hs, tiles, strict=True):
                gmd.launch_gate_up(x, ids, wts, a, b, h, A, block_m=bm, warps=kw, tiled=t[:2] if tl else None)
        cfg = dict(block_m=bm, warps=kw, tiled=tl)
        try:
            err = rel_err(gmd.gluon_moe_decode(x, ids, wts, w1, w3, w2, A, block_m=bm, warps=kw,
                                               tiled=tiles[0] if tl else None), want)
            ms = per_layer_ms(gu, L)
            record(**base, kernel="gate_up", path="gluon", **cfg, ms=ms, max_rel_err=err, pct_of_copy=pct(bytes_gu, ms))
        except Exception as ex:  # a setting that does not compile here: recorded, not fatal
            record(**base, kernel="gate_up", path="gluon", **cfg, error=f"{type(ex).__name__}: {str(ex)[:300]}")
    outs = [torch.zeros(N, D, device="cuda") for _ in range(L)]
    for bm, kw, sp, tl in DOWN[shape][:1] if quick else DOWN[shape]:
        def dn(bm=bm, kw=kw, sp=sp, tl=tl):
            for (_, _, c), h, o, t in zip(layers, hs, outs, tiles, strict=True):
                gmd.launch_down(h, ids, wts, c, o, A, block_m=bm, warps=kw, split=sp, tiled=t[2] if tl else None)
        cfg = dict(block_m=bm, warps=kw, split=sp, tiled=tl)
        try:
            err = rel_err(gmd.gluon_moe_decode(x, ids, wts, w1, w3, w2, A, block_m_down=bm, warps_down=kw, split=sp,
                                               tiled=tiles[0] if tl else None), want)
            ms = per_layer_ms(dn, L)
            record(**base, kernel="down", path="gluon", **cfg, ms=ms, max_rel_err=err, pct_of_copy=pct(bytes_dn, ms))
        except Exception as ex:
            record(**base, kernel="down", path="gluon", **cfg, error=f"{type(ex).__name__}: {str(ex)[:300]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the default launch settings only")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    t0 = time.time()
    copy = copy_bandwidth()
    res = {"bench": "gluon_moe", "device": torch.cuda.get_device_name(), "environment": environment("cuda"),
           "date": time.strftime("%Y-%m-%d"), "copy_gbs": copy, "records": []}

    record = recorder(res, args.out)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        E, A, D, I, L = SHAPES[shape]
        layers = [(hls2(E, I, D, gen), hls2(E, I, D, gen), hls2(E, D, I, gen)) for _ in range(L)]
        for N in (1, 4):
            try:
                bench_case(record, copy, args.quick, shape, A, layers, N, gen)
            except Exception as ex:  # a failing case is recorded; the next still runs
                record(shape=shape, batch=N, error=f"{type(ex).__name__}: {str(ex)[:500]}")
        del layers
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
