"""Decode attention speed of an outlier-free 2-bit NUQ cache (what a Hadamard-rotated nuq-outlier recipe stores):
the study kernel benchmarks/studies/swapab_attention.py (swapped operands, the dequantized history as tl.dot's left
operand) against the runtime's kernel on the same cache
(moec/kernels/kv_decode_attention.py with no residuals) and torch SDPA (flash and default) on an fp16 cache.
Mixtral-8x7B attention shape, one step = 32 layers' separate caches (bench_kv_attention.py's protocol:
random packed codes, CUDA events, median of --reps). GB/s = bytes the kernel must read / time; copy
bandwidth measured in the same run.

    python3 -m benchmarks.studies.bench_nuq_attention --sweep --out $OUT/nuq_sweep.json     (launch knobs)
    python3 -m benchmarks.studies.bench_nuq_attention --out benchmarks/results/nuq_attention_h200.json

Each record: recipe, context, batch, ms_median, GBps, pct_of_copy_bw, speedup_vs_sdpa (against the faster of
SDPA flash and default, timed in the same run), and the old kernel's time on the same bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_kv_attention import BLOCK, LAYERS, WIN, D, H, K, make_layer
from benchmarks.benchutil import ROOT, copy_bandwidth, graph_times, stats, time_step
from benchmarks.studies import swapab_attention as na
from moec.atomic import write_json, write_text
from moec.kernels.kv_decode_attention import kv_decode_attention, kv_decode_attention_ref

GRID = ((4096, 1), (32768, 1), (32768, 16), (131072, 1))
RECIPE = "kv-nuq2-rot"


GRAPHS = True  # time CUDA-graph replays of the 32-layer step (as the decode engine runs it), not Python launches


def timed(fn, reps: int) -> list[float]:
    """Per-step times in ms: graph replays of fn (captured after a warm-up), or eager calls."""
    return graph_times(fn, reps) if GRAPHS else time_step(fn, reps)


def new_args(t, q):
    return (q, t["k_codes"], t["v_codes"], t["k_scale"], t["v_scale"], t["k_lev"], t["v_lev"], t["hist_len"],
            t["win_k"], t["win_v"], t["win_len"])


def old_args(t, q):
    return (q, t["k_codes"], t["v_codes"], t["k_scale"], t["v_scale"], t["k_lev"], t["v_lev"], t["k_oidx"],
            t["k_oval"], t["v_oidx"], t["v_oval"], t["hist_len"], t["win_k"], t["win_v"], t["win_len"])


def step_bytes(layers, q) -> int:
    names = ("k_codes", "v_codes", "k_scale", "v_scale", "k_lev", "v_lev", "k_center", "win_k", "win_v")
    return sum(t[n].numel() * t[n].element_size() for t in layers for n in names) + q.numel() * q.element_size()


def time_new(layers, q, reps, **kw):
    ts = timed(lambda: [na.nuq_attention(*new_args(t, q), k_center=t["k_center"], **kw) for t in layers], reps)
    k = na._LAST.get("kernel")
    return stats(ts) | {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None)}


def time_old(layers, q, reps, **kw):
    ts = timed(lambda: [kv_decode_attention(*old_args(t, q), bits=2, block=BLOCK, k_center=t["k_center"], **kw)
                        for t in layers], reps)
    return stats(ts)


def sweep_runtime(base, records, save, reps):
    """Launch knobs of the runtime's kernel on the outlier-free cache, timed as graph replays (its CONFIG came
    from an eager sweep, where batch-1 steps were bound by Python launch overhead)."""
    knobs = [dict(block_t=bt, waves=w, num_stages=st) for bt in (32, 64) for w in (1, 2, 4, 8, 16) for st in (2, 3)]
    for S, B in ((4096, 1), (32768, 1), (131072, 1), (32768, 16)):
        layers = layers_for(B, S)
        q = torch.randn(B, H, D, device="cuda").half()
        nbytes = step_bytes(layers, q)
        for kw in knobs:
            rec = base | {"metric": "sweep_runtime_kernel", "context": S, "batch": B, "knobs": kw}
            try:
                rec |= time_old(layers, q, reps, **kw)
                rec["GBps"] = nbytes / (rec["ms_median"] / 1e3) / 1e9
            except Exception as e:
                rec["error"] = repr(e)[:400]
            records.append(rec)
            print(S, B, kw, round(rec.get("ms_median", -1), 3), round(rec.get("GBps", -1)), rec.get("error", ""),
                  flush=True)
        save()
        del layers
        torch.cuda.empty_cache()


def time_sdpa(B, S, q, reps) -> dict:
    kv = [(torch.randn(B, K, S + WIN, D, device="cuda").half(), torch.randn(B, K, S + WIN, D, device="cuda").half())
          for _ in range(LAYERS)]
    q4 = q[:, :, None]
    out = {"bytes_per_step": sum(2 * k.numel() * 2 for k, _ in kv)}
    for name, backends in (("flash", [torch.nn.attention.SDPBackend.FLASH_ATTENTION]), ("default", None)):
        try:
            def run(backends=backends, kv=kv):
                if backends is None:
                    return [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in kv]
                with torch.nn.attention.sdpa_kernel(backends):
                    return [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in kv]
            out[f"sdpa_{name}"] = stats(timed(run, reps))
        except Exception as e:
            out[f"sdpa_{name}"] = {"error": repr(e)[:300]}
    del kv
    torch.cuda.empty_cache()
    return out


def ir_summary() -> dict:
    """What the compiler made of the last compiled kernel: wgmma or mma, layout conversions, shared memory."""
    k = na._LAST.get("kernel")
    if k is None:
        return {}
    ttgir = k.asm.get("ttgir", "")
    ptx = k.asm.get("ptx", "")
    return {"warp_group_dot": ttgir.count("warp_group_dot"), "tt_dot": ttgir.count("tt.dot "),
            "convert_layout": ttgir.count("convert_layout"), "local_alloc": ttgir.count("local_alloc"),
            "local_load": ttgir.count("local_load"), "ptx_wgmma": ptx.count("wgmma.mma_async"),
            "ptx_mma_sync": ptx.count("mma.sync"), "ptx_ldmatrix": ptx.count("ldmatrix"),
            "ptx_st_shared": ptx.count("st.shared"), "ptx_ld_shared": ptx.count("ld.shared"),
            "shared_bytes": getattr(k, "metadata", None) and getattr(k.metadata, "shared", None)}


def layers_for(B, S):
    layers = [make_layer(B, S, 2, frac=0.0) for _ in range(LAYERS)]
    torch.cuda.synchronize()
    return layers


def check(base, records, save):
    """Kernel vs the torch reference at 32k (one layer), and the old kernel on the same inputs."""
    for B in (1, 4):
        t = make_layer(B, 32768, 2, frac=0.0)
        t["hist_len"] = torch.tensor([32768 - 64 * i for i in range(B)], dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, D, device="cuda").half()
        out = na.nuq_attention(*new_args(t, q), k_center=t["k_center"])
        ref = kv_decode_attention_ref(*old_args(t, q), bits=2, block=BLOCK, k_center=t["k_center"])
        old = kv_decode_attention(*old_args(t, q), bits=2, block=BLOCK, k_center=t["k_center"])
        rec = base | {"metric": "max_abs_err_vs_ref", "context": 32768, "batch": B,
                      "new": (out - ref).abs().max().item(), "old": (old - ref).abs().max().item(),
                      "ref_absmax": ref.abs().max().item()}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    save()


def sweep(base, records, save, reps):
    knobs = [dict(block_t=bt, num_warps=w, num_stages=st, deq=dq) for bt in (64, 128) for w in (4, 8)
             for st in (2, 3) for dq in (0, 1)]
    for S, B in ((32768, 16), (32768, 1)):
        layers = layers_for(B, S)
        q = torch.randn(B, H, D, device="cuda").half()
        nbytes = step_bytes(layers, q)
        for kw in knobs + ([dict(waves=w) for w in (2, 8, 16)] if B == 1 else []):
            rec = base | {"metric": "sweep", "context": S, "batch": B, "knobs": kw}
            try:
                rec |= time_new(layers, q, reps, **kw)
                rec["GBps"] = nbytes / (rec["ms_median"] / 1e3) / 1e9
                rec["ir"] = ir_summary()
            except Exception as e:
                rec["error"] = repr(e)[:400]
            records.append(rec)
            save()
            print(S, B, kw, round(rec.get("ms_median", -1), 3), round(rec.get("GBps", -1)), rec.get("n_regs"),
                  rec.get("n_spills"), rec.get("ir"), rec.get("error", ""), flush=True)
        del layers
        torch.cuda.empty_cache()


def ablate(base, records, save, reps, ir_dir: Path | None):
    """Leave-one-stage-out variants at the launch config (METHOD.md: time differences, no counters)."""
    for S, B in ((32768, 16), (32768, 1)):
        layers = layers_for(B, S)
        q = torch.randn(B, H, D, device="cuda").half()
        nbytes = step_bytes(layers, q)
        for abl in (0, 1, 2, 3):
            rec = base | {"metric": "ablation", "context": S, "batch": B, "ablate": abl, "config": dict(na.CONFIG),
                          "what": ["full", "no value products", "no products (level lookups only)",
                                   "loads only"][abl]}
            try:
                rec |= time_new(layers, q, reps, ablate=abl)
                rec["GBps"] = nbytes / (rec["ms_median"] / 1e3) / 1e9
                rec["ir"] = ir_summary()
                k = na._LAST.get("kernel")
                if ir_dir is not None and k is not None and S == 32768 and B == 16:
                    for kind in ("ttgir", "ptx"):
                        write_text(ir_dir / f"nuq_attention_abl{abl}.{kind}", k.asm.get(kind, ""))
            except Exception as e:
                rec["error"] = repr(e)[:400]
            records.append(rec)
            save()
            print(S, B, abl, round(rec.get("ms_median", -1), 3), round(rec.get("GBps", -1)), rec.get("n_regs"),
                  rec.get("error", ""), flush=True)
        rec = base | {"metric": "ablation", "context": S, "batch": B, "what": "unswapped kernel, same cache"}
        rec |= time_old(layers, q, reps)
        rec["GBps"] = nbytes / (rec["ms_median"] / 1e3) / 1e9
        records.append(rec)
        print(S, B, "old", round(rec["ms_median"], 3), flush=True)
        del layers
        torch.cuda.empty_cache()


def grid(base, records, save, bw, reps):
    for S, B in GRID:
        rec = base | {"metric": "decode_attention_step", "context": S, "batch": B, "config": dict(na.CONFIG)}
        try:
            layers = layers_for(B, S)
            q = torch.randn(B, H, D, device="cuda").half()
            rec["bytes_per_step"] = step_bytes(layers, q)
            rec |= time_new(layers, q, reps)
            rec["ir"] = ir_summary()
            rec["GBps"] = rec["bytes_per_step"] / (rec["ms_median"] / 1e3) / 1e9
            rec["pct_of_copy_bw"] = 100 * rec["GBps"] / bw
            rec["unswapped_kernel"] = time_old(layers, q, reps)
            del layers
            torch.cuda.empty_cache()
            rec["peer"] = time_sdpa(B, S, q, reps)
            ok = [p["ms_median"] for p in rec["peer"].values() if isinstance(p, dict) and "ms_median" in p]
            rec["speedup_vs_sdpa"] = min(ok) / rec["ms_median"]
            rec["speedup_unswapped_vs_sdpa"] = min(ok) / rec["unswapped_kernel"]["ms_median"]
        except Exception as e:
            rec["error"] = repr(e)[:500]
            traceback.print_exc()
        torch.cuda.empty_cache()
        records.append(rec)
        save()
        print(json.dumps({k: rec.get(k) for k in ("context", "batch", "ms_median", "GBps", "pct_of_copy_bw",
                                                  "speedup_vs_sdpa", "speedup_unswapped_vs_sdpa")}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-runtime", action="store_true", help="sweep the runtime kernel's launch knobs")
    ap.add_argument("--ablate", type=Path, default=None, help="run the ablations; write the IR under this folder")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replays")
    ap.add_argument("--config", type=json.loads, default=None, help='launch knobs, e.g. \'{"block_t": 128}\'')
    a = ap.parse_args()
    if a.config:
        na.CONFIG.update(a.config)
    global GRAPHS
    GRAPHS = not a.eager
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or None
    base = {"bench": "nuq_attention", "git_sha": sha, "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(0), "recipe": RECIPE,
            "shape": f"mixtral-8x7b attention: {H} q heads, {K} KV heads, head_dim {D}, {LAYERS} layers",
            "method": "2-bit NUQ history (no outliers, post-RoPE centered keys) + fp16 window"}
    records = []

    def save():
        write_json(a.out, records)

    t0 = time.time()
    check(base, records, save)
    base["timing"] = "CUDA graph replay of the 32-layer step" if GRAPHS else "eager launches"
    if a.ablate:
        a.ablate.mkdir(parents=True, exist_ok=True)
        ablate(base, records, save, a.reps, a.ablate)
    elif a.sweep:
        sweep(base, records, save, a.reps)
    elif a.sweep_runtime:
        sweep_runtime(base, records, save, a.reps)
    else:
        bw = copy_bandwidth()
        records.append(base | {"metric": "copy_bandwidth_GBps", "value": bw})
        grid(base, records, save, bw, a.reps)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    save()


if __name__ == "__main__":
    main()
