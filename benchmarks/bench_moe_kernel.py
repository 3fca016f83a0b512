"""Fused quantized MoE kernels and the 4-bit attention linear vs bf16 peers at real layer shapes (H200).

    python3 -m benchmarks.bench_moe_kernel --out benchmarks/results/moe_kernel_h200.json   (~110 s cold)
    python3 -m benchmarks.bench_moe_kernel --out X.json --sweep --budget 95   (+ block sweeps: 122 s cold)
    python3 -m benchmarks.bench_moe_kernel --out /tmp/dry.json --dry          (CPU interpreter, toy shapes)
    python3 -m benchmarks.bench_moe_kernel --out X.json --quick   (decode batch 1: bf16, hls2, vq2/3, tcq2/3)

The committed file came from the second command on an H200 (2026-11-30); the JSON is rewritten
after every record, so a run cut short keeps what it measured.

MoE layers: Mixtral-8x7B (8 experts, top-2, 4096 -> 14336) and Qwen3-30B-A3B (128 experts, top-8,
2048 -> 768), random weights (speed does not depend on values; fp8 from real normals so no NaN codes).
Decode batches 1 and 16; prefill 2048 tokens. Quantized modes: hls2/hls3 layout (2/3-bit codes, one
fp16 table per row: `lut`), fp8 e4m3 + fp32 row scales, vq2/vq3 vector codebooks (2 bits x d = 4: 8-bit
codes, K = 256; 3 bits x d = 2: 6-bit codes, K = 64; fp16 codebook per expert matrix + fp16 row scales,
kernels/dequant.gemv_vq; tcq2/tcq3 trellis codes, runtime/tcq.py, MODE_TCQ with fp32 row scales; decode runs the
word-chunk default, `config: {"vq_gather": true}` (codebook
lookups by tl.gather, i.e. shared memory) and `{"words": false}` (byte codes), as separate records).
hls2 decode runs twice: the default (the PTX prmt lookup with fp16x2 products, kernels/dequant.gemv_prmt)
and `config: {"prmt": false}` (the previous select-tree / cubic path), as separate records. Peers: the
runtime's bf16 path (torch matmuls per selected expert + index_add), the bf16 grouped reference (the
same Triton kernels on bf16 weights), and torch._grouped_mm (bf16) for prefill where this torch has it.

Timing: each measured call runs L layers with separate weight buffers (more bytes than the 60 MB L2),
captured in one CUDA graph and replayed (`ms_median`, per layer; a runtime decode step is a graph too),
plus the eager time (`ms_eager`, includes Python launch overhead). The torch per-expert peer syncs on
ids.unique() and cannot be captured: eager only. Bytes = packed codes + tables/scales of the experts a
step touches; `pct_of_copy` compares bytes/time with a device-to-device copy (read + write) measured
in the same run. Correctness: every timed config is checked against the fp32 torch reference on
layer 0 (`max_rel_err_vs_ref` = max |err| / max |ref|).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--dry" in sys.argv:  # CPU dry run of the whole script at toy shapes (Triton interpreter)
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

from moec.kernels.dequant import (
    MODE_AFFINE,
    MODE_DENSE,
    MODE_FP8,
    MODE_LUT,
    MODE_TCQ,
    MODE_VQ,
    QWeight,
    use_prmt,
)
from moec.kernels.moe_decode import _PRMT_FAILED, moe_decode, moe_decode_ref
from moec.kernels.moe_prefill import moe_grouped, moe_grouped_ref
from moec.kernels.qlinear import qlinear, qlinear_ref
from moec.runtime.experts import lut_poly
from moec.runtime.tcq import hold_tcq, random_tcq
from moec.runtime.weightcodecs import random_vq

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
BATCHES = (1, 16, 2048)
ATTN = ((4096, 4096), (4096, 1024))
DEV = "cuda"
if "--dry" in sys.argv:
    SHAPES = {"toy-a": (4, 2, 64, 96), "toy-b": (8, 4, 64, 32)}
    BATCHES, ATTN, DEV = (1, 3, 40), ((64, 48),), "cpu"
KINDS = {"hls2": (MODE_LUT, 2), "hls3": (MODE_LUT, 3), "fp8": (MODE_FP8, 8), "bf16": (MODE_DENSE, 16),
         "vq2": (MODE_VQ, 2), "vq3": (MODE_VQ, 3), "tcq2": (MODE_TCQ, 2), "tcq3": (MODE_TCQ, 3)}
VQ_DIM = {"vq2": 4, "vq3": 2}  # vector length d of the vq kinds
T0 = time.time()


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30 if DEV == "cuda" else 1 << 20, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = eager_time(lambda: b.copy_(a), rep=200)
    return 2 * a.numel() / ms / 1e6  # GB/s, read + write


def make_weight(kind: str, E: int, O: int, n_in: int, gen, group: int = 0) -> QWeight:
    mode, bits = {**KINDS, "rtn4": (MODE_AFFINE, 4), "hls4": (MODE_LUT, 4)}[kind]
    if mode == MODE_DENSE:
        return QWeight(mode, bits, n_in, torch.randn(E, O, n_in, device=DEV, generator=gen, dtype=torch.bfloat16))
    if mode == MODE_FP8:
        w = torch.randn(E, O, n_in, device=DEV, generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        return QWeight(mode, bits, n_in, w, torch.rand(E, O, device=DEV, generator=gen) * 0.01)
    if mode == MODE_TCQ:  # trellis streams + fp32 row scales (as runtime/tcq.hold_tcq holds them)
        held = hold_tcq(bits, random_tcq(bits, (E, O, n_in), 0, DEV, gen))
        return QWeight(mode, bits, n_in, held["codes"], held["scale"])
    if mode == MODE_VQ:  # BITSTREAM codes + fp16 codebook [E, K, d] + fp16 row scales
        st = random_vq(bits, (E, O, n_in), VQ_DIM[kind], DEV, gen)
        return QWeight(mode, bits, n_in, st["codes"], st["codebook"], st["row_scale"])
    G = n_in // group if group else 1
    per = {2: 4, 3: 8, 4: 2}[bits]
    nbytes = -(-n_in // per) * (3 if bits == 3 else 1)
    codes = torch.randint(0, 256, (E, O, nbytes), dtype=torch.uint8, device=DEV, generator=gen)
    if mode == MODE_LUT:  # 2-bit: with the tables' cubics, as the runtime holds them (decode on the FMA pipe)
        lut = (torch.randn(E, O, G, 1 << bits, device=DEV, generator=gen).sort(-1).values * 0.02).half()
        return QWeight(mode, bits, n_in, codes, lut, lut_poly(lut) if bits == 2 else None)
    scale = (torch.rand(E, O, G, device=DEV, generator=gen) * 0.01).half()
    return QWeight(mode, bits, n_in, codes, scale, (-8 * scale.float()).half())


def nbytes(w: QWeight, experts: int | None = None) -> int:
    """Bytes a kernel must read for `experts` experts of w (all when None)."""
    tot = sum(t.numel() * t.element_size() for t in (w.data, w.a, w.b) if t is not None)
    return tot if experts is None else tot * experts // w.data.shape[0]


def graph_time(fn, rep=100) -> float:
    """Median ms of fn() replayed from a CUDA graph (fn already warmed up / compiled)."""
    if DEV != "cuda":
        return eager_time(fn)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = triton.testing.do_bench(g.replay, rep=rep, return_mode="median")
    del g
    return ms


def eager_time(fn, rep=100) -> float:
    if DEV != "cuda":  # dry run: one timed call
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, rep=rep, return_mode="median")


def bf16_torch_moe(x, ids, wts, w1, w3, w2):
    """The runtime's bf16 path (moec/runtime/model.py MoE.forward without a codec)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok]
        y = torch.nn.functional.silu(xe @ w1[e].t()) * (xe @ w3[e].t()) @ w2[e].t()
        out.index_add_(0, tok, (y * wts[tok, slot, None]).to(x.dtype))
    return out


def grouped_mm_moe(x, ids, wts, w1, w3, w2):
    """bf16 grouped GEMM peer through torch._grouped_mm (tokens sorted by expert)."""
    N, A = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // A]
    g = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(torch.nn.functional.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    y = y * wts.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(N * A, x.shape[1], dtype=x.dtype, device=x.device)
    out[order] = y
    return out.view(N, A, -1).sum(1)


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def bench_moe(timed, record, a, shape, E, A, D, I, N, L, ws, g):
    """All methods for one (shape, batch): bf16 peers first, then the quantized kinds."""
    x = torch.randn(N, D, device=DEV, dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:A] for _ in range(N)])
    wts = torch.softmax(torch.randn(N, A, device=DEV, generator=g), -1)
    n_active = ids.unique().numel()
    base = dict(shape=shape, experts=E, top_k=A, dim=D, expert_dim=I, batch=N, active_experts=n_active)
    bf = [tuple(w.data for w in ly) for ly in ws["bf16"]]
    ref_fn = moe_decode_ref if N <= 16 else moe_grouped_ref
    peers = {}
    if N <= 16:
        ms = eager_time(lambda: [bf16_torch_moe(x, ids, wts, *bf[i]) for i in range(L)]) / L
        peers["bf16_torch_per_expert"] = ms
        record(method="bf16-torch-per-expert", ms_eager=ms, ms_median=ms, bytes_per_step=n_active * 3 * I * D * 2,
               **base)
    else:
        try:
            grouped_mm_moe(x, ids, wts, *bf[0])
            ms = eager_time(lambda: [grouped_mm_moe(x, ids, wts, *bf[i]) for i in range(L)]) / L
            peers["bf16_torch_grouped_mm"] = ms
            record(method="bf16-torch-grouped-mm", ms_median=ms, ms_eager=ms, **base)
        except Exception as ex:  # torch without _grouped_mm, or shapes it refuses
            record(method="bf16-torch-grouped-mm", error=f"{type(ex).__name__}: {str(ex)[:300]}", **base)
    for kind in [k for k in ("bf16", "hls2", "hls3", "fp8", "vq2", "vq3", "tcq2", "tcq3") if k in KINDS]:
        act_bytes = sum(nbytes(w, n_active) for w in ws[kind][0])
        variants = []
        if N <= 16:
            dec = [{}]
            if kind == "hls2":  # the previous 2-bit path beside the prmt default
                dec.append(dict(prmt=False))
            if kind in VQ_DIM:  # the tl.gather and byte-code GEMVs beside the word-chunk default
                dec += [dict(vq_gather=True), dict(words=False)]
            if a.sweep and kind == "hls2":
                dec += [dict(poly=False)] + [dict(block_o=bo, block_k=bk, num_warps=nw, block_o_down=bo,
                                                  block_k_down=bk) for bo, bk, nw in
                                             ((32, 1024, 8), (16, 2048, 8), (8, 1024, 4), (16, 512, 4))]
            variants += [("fused-decode", moe_decode, c) for c in dec]
        grp = [{}]
        if a.sweep and kind == "hls2":
            grp += ([dict(block_m=16, block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in
                     ((32, 256, 4), (64, 128, 8))] if N <= 16 else
                    [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=st)
                     for bm, bn, bk, nw, st in ((256, 64, 64, 8, 3), (128, 128, 64, 8, 4))])
        if not a.quick:
            variants += [("grouped", moe_grouped, c) for c in grp]
        ref = []
        for name, fn, cfg in variants:
            if cfg and not {"prmt", "words", "vq_gather"} & set(cfg) and time.time() - T0 > a.budget:
                # the old-path / byte-code records always run
                continue

            def want(kind=kind, ref=ref):
                if not ref:
                    ref.append(ref_fn(x, ids, wts, *ws[kind][0]))
                return ref[0]

            rec = timed(f"{kind}-{name}", lambda i, fn=fn, cfg=cfg, kind=kind: fn(x, ids, wts, *ws[kind][i], **cfg),
                        want, L, config=cfg or "default", bytes_per_step=act_bytes, **base)
            if rec.get("ms_median"):
                rec["speedup_vs"] = {k: v / rec["ms_median"] for k, v in peers.items()}
            if name == "fused-decode" and kind == "hls2":  # which 2-bit path ran (prmt falls back if it fails)
                on = cfg.get("prmt") is not False and all(use_prmt(w) for w in ws[kind][0]) and not _PRMT_FAILED
                rec["decode_path"] = "prmt" if on else "select/poly"
                if _PRMT_FAILED:
                    rec["prmt_error"] = _PRMT_FAILED[0]
            if name == "fused-decode" and kind in VQ_DIM:
                words = cfg.get("words") is not False and all(w.vq_words() for w in ws[kind][0])
                rec["decode_path"] = "vq-bytes" if not words else "vq-gather" if cfg.get("vq_gather") else "vq-words"
        if kind == "bf16":  # the best bf16 Triton time is the "bf16 grouped reference" peer
            times = [r["ms_median"] for r in records_of(record) if r.get("method", "").startswith("bf16-")
                     and r.get("batch") == N and r.get("shape") == shape and r.get("ms_median")
                     and r["method"] in ("bf16-grouped", "bf16-fused-decode")]
            if times:
                peers["bf16_triton_best"] = min(times)


def bench_attn(timed, record, a, K, O, M, wq, g):
    L = len(wq["bf16"])
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
    base = dict(shape=f"attn-{K}x{O}", batch=M, dim=K, out_dim=O, group_size=min(128, K))
    ms = eager_time(lambda: [torch.nn.functional.linear(x, wq["bf16"][i].data[0]) for i in range(L)]) / L
    msg = graph_time(lambda: [torch.nn.functional.linear(x, wq["bf16"][i].data[0]) for i in range(L)]) / L
    record(method="bf16-torch-linear", ms_median=msg, ms_eager=ms, bytes_per_step=K * O * 2, **base)
    for kind in ("rtn4", "hls4", "bf16"):
        cfgs = [{}]
        if a.sweep and kind == "rtn4" and time.time() - T0 < a.budget:
            cfgs += ([dict(block_o=bo, block_k=bk, num_warps=nw) for bo, bk, nw in ((2, 2048, 4), (8, 1024, 8))]
                     if M == 1 else [dict(block_m=16, block_n=bn, block_k=bk, num_warps=nw)
                                     for bn, bk, nw in ((64, 128, 4), (32, 256, 4))])
        for cfg in cfgs:
            rec = timed(f"{kind}-qlinear", lambda i, kind=kind, cfg=cfg: qlinear(x, wq[kind][i], **cfg),
                        lambda kind=kind: qlinear_ref(x, wq[kind][0]), L, config=cfg or "default",
                        bytes_per_step=nbytes(wq[kind][0]), **base)
            if rec.get("ms_median"):
                rec["speedup_vs_bf16_torch_linear"] = msg / rec["ms_median"]


def records_of(record) -> list:
    return record.records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true", help="also try block configs (hand sweep)")
    ap.add_argument("--budget", type=float, default=140.0, help="seconds; sweeps stop when it is spent")
    ap.add_argument("--dry", action="store_true", help="CPU dry run at toy shapes (checks the script, no timings)")
    ap.add_argument("--quick", action="store_true",
                    help="decode batch 1, bf16, hls2, vq2, vq3, tcq2 and tcq3 only (no prefill, attention)")
    a = ap.parse_args()
    global BATCHES, KINDS, ATTN
    if a.quick:
        BATCHES, ATTN = (1,), ()
        KINDS = {k: v for k, v in KINDS.items() if k in ("hls2", "bf16", "vq2", "vq3", "tcq2", "tcq3")}
    from moec.cli.common import base_record, write_json_atomic

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    records = []

    def record(**kw):
        rec = base_record("moe-kernel", DEV) | {"copy_gbps": bw} | kw
        if "bytes_per_step" in kw and kw.get("ms_median"):
            rec["gbps"] = kw["bytes_per_step"] / kw["ms_median"] / 1e6
            rec["pct_of_copy"] = 100 * rec["gbps"] / bw
        records.append(rec)
        write_json_atomic(a.out, records)  # after every record: a run cut short keeps what it measured
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                          if k in ("shape", "batch", "tokens", "method", "config", "ms_median", "ms_eager",
                                   "pct_of_copy", "max_rel_err_vs_ref", "error")}), f"t={time.time() - T0:.0f}s",
              flush=True)
        return rec

    record.records = records

    def timed(method, fn, ref_fn, L, **extra):
        try:
            got = fn(0)
            err = rel_err(got, ref_fn()) if ref_fn is not None else None
            ms_e = eager_time(lambda: [fn(i) for i in range(L)]) / L
            try:
                ms, gerr = graph_time(lambda: [fn(i) for i in range(L)]) / L, None
            except Exception as ex:  # not capturable: report the eager time
                ms, gerr = ms_e, f"{type(ex).__name__}: {str(ex)[:200]}"
            return record(method=method, ms_median=ms, ms_eager=ms_e, max_rel_err_vs_ref=err, graph_error=gerr,
                          **extra)
        except Exception as ex:  # record and go on: one failing config must not lose the others
            traceback.print_exc()
            return record(method=method, error=f"{type(ex).__name__}: {str(ex)[:300]}", **extra)

    g = torch.Generator(device=DEV).manual_seed(0)
    for shape, (E, A, D, I) in SHAPES.items():
        L = 1 if DEV != "cuda" else 2 if shape.startswith("mixtral") else 12
        ws = {k: [tuple(make_weight(k, E, *oi, g) for oi in ((I, D), (I, D), (D, I))) for _ in range(L)]
              for k in KINDS}
        for N in BATCHES:
            bench_moe(timed, record, a, shape, E, A, D, I, N, L, ws, g)
        ws = None
        if DEV == "cuda":
            torch.cuda.empty_cache()
    for K, O in ATTN:  # 4-bit attention projections (Mixtral q/o and k/v), group 128
        wq = {k: [make_weight(k, 1, O, K, g, group=min(128, K)) for _ in range(16 if DEV == "cuda" else 1)]
              for k in ("rtn4", "hls4", "bf16")}
        for M in (1, 16):
            bench_attn(timed, record, a, K, O, M, wq, g)
        wq = None
    write_json_atomic(a.out, records)
    print(f"wrote {a.out} ({len(records)} records) in {time.time() - T0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
