"""The Gluon decode-attention kernel over the 2-bit nuq cache against the `tl` kernel and the fp16 cache's
attention, on the H200 (issue 31): correctness against the torch reference, then step times.

Correctness: moec.kernels.gluon_kv_attention vs kv_decode_attention_ref (fp32 torch) on random caches: query
heads per KV head G in {1, 4, 8, 16}, ragged history and window lengths, key centers and the score bias on and
off, a head_dim rotation undone in the combine; the max abs error and the `tl` kernel's on the same inputs.

Timing (CUDA-graph replays, as the decode engine runs a step): one step = attention of one query token per
sequence over LAYERS separate caches (no layer is served from L2 by the previous one), for the Mixtral-8x7B
(32 query heads, 8 KV heads) and Qwen3-30B-A3B (32 / 4, 48 layers) attention shapes at 4k and 32k, batch 1 and
16: the Gluon kernel + split combine, the `tl` kernel + combine, and moec's fp16-cache kernel
(fp16_decode_attention) on an fp16 cache of the same length. pct_of_copy = bytes the kernel must read (codes,
value scales, window, q) / time / the copy bandwidth measured in the same run. --sweep adds the launch knobs.

    python3 -m benchmarks.bench_gluon_kv_attention --out benchmarks/results/gluon_kv_attention_h200.json --sweep
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.benchutil import copy_bandwidth, graph_times
from moec.atomic import write_json
from moec.kernels import gluon_kv_attention as gka
from moec.kernels.fp16_decode_attention import fp16_decode_attention
from moec.kernels.kv_decode_attention import kv_decode_attention, kv_decode_attention_ref

D, BLOCK = 128, 32
SHAPES = {"mixtral": (32, 8, 32), "qwen3": (32, 4, 48)}  # query heads, KV heads, layers


def make_cache(B, H, K, S, win, dev="cuda", hist_len=None, win_len=None, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.rand(*s, device=dev, generator=g)  # noqa: E731
    n = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    return {
        "q": n(B, H, D).half(),
        "k_codes": torch.randint(0, 256, (B, K, S, D // 4), dtype=torch.uint8, device=dev, generator=g),
        "v_codes": torch.randint(0, 256, (B, K, S, D // 4), dtype=torch.uint8, device=dev, generator=g),
        "k_scale": r(K, D) + 0.5,
        "v_scale": (r(B, K, S) + 0.5).half(),
        "k_lev": torch.tensor([-1.3, -0.4, 0.35, 1.2], device=dev),  # non-uniform, as nuq's
        "v_lev": torch.tensor([-1.5, -0.45, 0.5, 1.4], device=dev),
        "hist_len": (torch.full((B,), S, dtype=torch.int32, device=dev) if hist_len is None
                     else torch.tensor(hist_len, dtype=torch.int32, device=dev)),
        "win_k": n(B, K, win, D).half(),
        "win_v": n(B, K, win, D).half(),
        "win_len": (torch.full((B,), win, dtype=torch.int32, device=dev) if win_len is None
                    else torch.tensor(win_len, dtype=torch.int32, device=dev)),
        "k_center": n(K, D) * 0.3,
        "k_err2": r(K, D) * 0.05,
    }


def gluon_call(c, center=True, bias=True, rotation=None, **kw):
    return gka.gluon_kv_attention(c["q"], c["k_codes"], c["v_codes"], c["k_scale"], c["v_scale"], c["k_lev"],
                                  c["v_lev"], c["hist_len"], c["win_k"], c["win_v"], c["win_len"],
                                  k_center=c["k_center"] if center else None, k_err2=c["k_err2"] if bias else None,
                                  out_rotation=rotation, **kw)


def tl_call(c, center=True, bias=True, rotation=None, **kw):
    """The `tl` kernel (what MOEC_KERNELS=tl runs)."""
    B, K = c["k_codes"].shape[:2]
    NB = c["k_codes"].shape[2] // BLOCK
    e16 = torch.empty(B, K, NB, 0, dtype=torch.int16, device=c["q"].device)
    eh = torch.empty(B, K, NB, 0, dtype=torch.float16, device=c["q"].device)
    return kv_decode_attention(c["q"], c["k_codes"], c["v_codes"], c["k_scale"], c["v_scale"], c["k_lev"],
                               c["v_lev"], e16, eh, e16, eh, c["hist_len"], c["win_k"], c["win_v"], c["win_len"],
                               bits=2, block=BLOCK, k_center=c["k_center"] if center else None,
                               k_err2=c["k_err2"] if bias else None, out_rotation=rotation, **kw)


def ref_call(c, center=True, bias=True, rotation=None):
    B, K = c["k_codes"].shape[:2]
    NB = c["k_codes"].shape[2] // BLOCK
    e16 = torch.empty(B, K, NB, 0, dtype=torch.int16, device=c["q"].device)
    eh = torch.empty(B, K, NB, 0, dtype=torch.float16, device=c["q"].device)
    out = kv_decode_attention_ref(c["q"], c["k_codes"], c["v_codes"], c["k_scale"], c["v_scale"], c["k_lev"],
                                  c["v_lev"], e16, eh, e16, eh, c["hist_len"], c["win_k"], c["win_v"], c["win_len"],
                                  bits=2, block=BLOCK, k_center=c["k_center"] if center else None,
                                  k_err2=c["k_err2"] if bias else None)
    return out if rotation is None else out @ rotation.T


def check(records):
    """Gluon vs the torch reference (and the tl kernel's error on the same inputs)."""
    cases = [  # B, H, K, S, window capacity, hist_len, win_len, center, bias, rotation
        (1, 32, 8, 4096, 148, None, None, True, True, False),
        (2, 32, 4, 1024, 148, [1024, 512], [148, 7], True, True, True),
        (3, 8, 8, 256, 64, [256, 32, 0], [64, 1, 33], False, False, False),
        (2, 16, 1, 512, 130, [480, 96], [130, 129], True, False, False),
        (1, 64, 4, 2048, 148, [2016], [100], False, True, True),
        (4, 32, 8, 64, 148, [64, 32, 0, 64], [0, 148, 3, 20], True, True, False),
    ]
    for i, (B, H, K, S, W, hl, wl, center, bias, rot) in enumerate(cases):
        c = make_cache(B, H, K, S, W, hist_len=hl, win_len=wl, seed=i)
        R = torch.linalg.qr(torch.randn(D, D, device="cuda"))[0].contiguous() if rot else None
        ref = ref_call(c, center, bias, R)
        rec = {"B": B, "H": H, "K": K, "S": S, "hist_len": hl or [S] * B, "win_len": wl or [W] * B,
               "center": center, "bias": bias, "rotation": rot, "ref_max_abs": ref.abs().max().item()}
        for key, knobs in (("gluon", {}), ("gluon_wg", {"warps": 4})):
            try:
                out = gluon_call(c, center, bias, R, **knobs)
                torch.cuda.synchronize()
                rec[f"{key}_max_err"] = (out - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rec[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
        rec["tl_max_err"] = (tl_call(c, center, bias, R) - ref).abs().max().item()
        tol = 2e-2 * max(1.0, rec["ref_max_abs"])
        rec["ok"] = all(rec.get(f"{k}_max_err", 1.0) <= tol for k in ("gluon", "gluon_wg"))
        print("check", rec, flush=True)
        records.append(rec)


def kernel_bytes(c) -> int:
    """Bytes the kernel must read: q, the codes, the value scales and the fp16 window."""
    return sum(c[k].numel() * c[k].element_size() for k in ("q", "k_codes", "v_codes", "v_scale", "win_k", "win_v"))


def time_shape(name, ctx, B, reps, bw, records, sweep=False):
    H, K, L = SHAPES[name]
    win = 128 + 4
    layers = [make_cache(B, H, K, ctx, win, seed=100 + i) for i in range(L)]
    step_bytes = sum(kernel_bytes(c) for c in layers)
    base = {"shape": name, "context": ctx, "batch": B, "layers": L, "bytes_per_step": step_bytes}

    def timed(label, fn, extra=None, n=None):
        try:
            ts = graph_times(fn, n or reps)
            ms = statistics.median(ts)
            rec = base | {"path": label, "ms_median": ms, "ms_min": min(ts),
                          "GBps": step_bytes / (ms / 1e3) / 1e9,
                          "pct_of_copy": 100 * step_bytes / (ms / 1e3) / 1e9 / bw} | (extra or {})
        except Exception as e:  # noqa: BLE001
            rec = base | {"path": label, "error": f"{type(e).__name__}: {str(e)[:300]}"} | (extra or {})
        print("time", rec, flush=True)
        records.append(rec)
        return rec

    cfg = gka.launch_config.config("kv_decode_attention", torch.device("cuda"))["gluon"]
    splits = gka.default_splits(B, ctx, cfg["block_t"], cfg, gka.launch_config.num_sms(torch.device("cuda")))
    base["default_splits"] = splits
    g = timed("gluon", lambda: [gluon_call(c) for c in layers])
    timed("gluon-kernel-only", lambda: [gluon_call(c, combine=False) for c in layers])
    t = timed("tl", lambda: [tl_call(c) for c in layers])
    if sweep:
        for knobs in ({"outc": 128}, {"n_splits": max(1, splits // 2)}, {"n_splits": splits * 2},
                      {"n_splits": max(1, splits // 2), "outc": 128}, {"warps": 4},
                      {"warps": 4, "n_splits": splits * 2}, {"warps": 4, "n_splits": splits * 4}):
            timed("gluon-sweep", lambda k=knobs: [gluon_call(c, **k) for c in layers], knobs, n=20)
    layers.clear()  # free the compressed caches before the fp16 ones
    torch.cuda.empty_cache()
    # the fp16 cache's attention at the same length (its kernel writes the new token at pos)
    kc = [torch.randn(B, K, ctx + win, D, device="cuda").half() for _ in range(L)]
    vc = [torch.randn(B, K, ctx + win, D, device="cuda").half() for _ in range(L)]
    q = torch.randn(B, H, D, device="cuda").half()
    kn = torch.randn(B, K, D, device="cuda").half()
    pos = torch.full((B,), ctx + win - 1, dtype=torch.int32, device="cuda")
    f = timed("fp16", lambda: [fp16_decode_attention(q, kc[i], vc[i], kn, kn, pos) for i in range(L)],
              {"bytes_per_step_fp16": 2 * L * B * K * (ctx + win) * D * 2})
    if "ms_median" in f:
        f["pct_of_copy"] = 100 * f["bytes_per_step_fp16"] / (f["ms_median"] / 1e3) / 1e9 / bw
        for r in (g, t):
            if "ms_median" in r:
                r["speedup_vs_fp16"] = f["ms_median"] / r["ms_median"]
    kc.clear()
    vc.clear()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python3 -m benchmarks.bench_gluon_kv_attention " + " ".join(sys.argv[1:]),
           "checks": [], "timings": []}
    import triton
    out["triton"] = triton.__version__
    check(out["checks"])
    bw = copy_bandwidth()
    out["copy_GBps"] = bw
    write_json(args.out, out)
    for name in SHAPES:
        for ctx in map(int, args.contexts.split(",")):
            for B in map(int, args.batches.split(",")):
                time_shape(name, ctx, B, args.reps, bw, out["timings"], sweep=args.sweep)
                write_json(args.out, out)
    out["seconds"] = time.time() - t0
    out["all_checks_ok"] = all(r.get("ok") for r in out["checks"])
    write_json(args.out, out)
    print("done", out["seconds"], "checks ok:", out["all_checks_ok"])


if __name__ == "__main__":
    main()
