"""Decode attention speed on the GPU: fused nuq-outlier kernel (2-bit history + 1% outliers + fp16
window) vs torch SDPA on an fp16 cache, Mixtral-8x7B attention shape (32 q heads, 8 KV heads, d 128).

One "step" = attention of one query token per sequence over 32 layers' separate cache buffers (so a
layer's cache is not served from L2 by the previous iteration), timed with CUDA events, median of
--reps after warm-up. Achieved GB/s = bytes the kernel must read (packed codes, value scales,
outlier indices and residuals, fp16 window, key channel scales) / time. Copy bandwidth: a 4 GiB
device-to-device copy (read + write counted), measured in the same run. Also runs the kernel vs the
torch reference at full size (32k context) and records the max error.

    python3 benchmarks/bench_kv_attention.py --out $OUT/kv_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moec.kernels.kv_decode_attention import kv_decode_attention, kv_decode_attention_ref  # noqa: E402

H, K, D, LAYERS, BLOCK, WIN = 32, 8, 128, 32, 32, 128 + 4 + 16  # window: 4 sinks + 128 recent + a partial block


def make_layer(B, S, bits, frac=0.01, dev="cuda", gen=None):
    NB = S // BLOCK
    nout = math.ceil(frac * BLOCK * D)
    dw = D * bits // 8
    t = {
        "k_codes": torch.randint(0, 256, (B, K, S, dw), dtype=torch.uint8, device=dev),
        "v_codes": torch.randint(0, 256, (B, K, S, dw), dtype=torch.uint8, device=dev),
        "k_scale": torch.rand(K, D, device=dev) + 0.5,
        "v_scale": (torch.rand(B, K, S, device=dev) + 0.5).half(),
        "k_lev": torch.linspace(-1, 1, 2**bits, device=dev),
        "v_lev": torch.linspace(-1, 1, 2**bits, device=dev),
        "k_oidx": torch.randint(0, BLOCK * D, (B, K, NB, nout), device=dev).to(torch.int16),
        "k_oval": torch.randn(B, K, NB, nout, device=dev).half(),
        "v_oidx": torch.randint(0, BLOCK * D, (B, K, NB, nout), device=dev).to(torch.int16),
        "v_oval": torch.randn(B, K, NB, nout, device=dev).half(),
        "hist_len": torch.full((B,), S, dtype=torch.int32, device=dev),
        "win_k": torch.randn(B, K, WIN, D, device=dev).half(),
        "win_v": torch.randn(B, K, WIN, D, device=dev).half(),
        "win_len": torch.full((B,), WIN, dtype=torch.int32, device=dev),
    }
    return t


ORDER = ("k_codes", "v_codes", "k_scale", "v_scale", "k_lev", "v_lev", "k_oidx", "k_oval", "v_oidx", "v_oval",
         "hist_len", "win_k", "win_v", "win_len")


def args_of(t, q):
    return (q, *(t[n] for n in ORDER))


def nbytes(t) -> int:
    return sum(x.numel() * x.element_size() for x in t.values())


def time_step(fn, reps: int) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def copy_bandwidth() -> float:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ts = time_step(lambda x=x, y=y: y.copy_(x), 10)
    return 2 * (4 << 30) / (statistics.median(ts) / 1e3) / 1e9


def stats(ts):
    ts = sorted(ts)
    return {"ms_median": statistics.median(ts), "ms_p10": ts[len(ts) // 10], "ms_p90": ts[(9 * len(ts)) // 10]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.cuda.get_device_name(0)
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or None
    base = {"bench": "kv_attention", "git_sha": sha, "date": time.strftime("%Y-%m-%d"), "device": dev,
            "shape": f"mixtral-8x7b attention: {H} q heads, {K} KV heads, head_dim {D}, {LAYERS} layers",
            "method": "nuq-outlier 2-bit fused decode attention", "recipe": "kv-nuq2-outlier"}
    records = []

    def save():
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(records, indent=1))

    bw = copy_bandwidth()
    records.append(base | {"metric": "copy_bandwidth_GBps", "value": bw})
    save()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)

    # correctness at full size: one layer, 32k context, batch 16 (2-bit) and batch 2 (3-bit)
    for bits, B in ((2, 16), (3, 2)):
        try:
            t = make_layer(B, 32768, bits)
            t["hist_len"][0] = 32768 - 5 * BLOCK  # one row with a shorter history
            t["win_len"][-1] = 37
            q = torch.randn(B, H, D, device="cuda").half()
            out = kv_decode_attention(*args_of(t, q), bits=bits, block=BLOCK)
            ref = kv_decode_attention_ref(*args_of(t, q), bits=bits, block=BLOCK)
            err = (out - ref).abs().max().item()
            records.append(base | {"metric": "max_abs_err_vs_ref", "bits": bits, "context": 32768, "batch": B,
                                   "value": err, "ref_absmax": ref.abs().max().item(), "pass": err < 5e-3,
                                   "dot_precision": "tf32"})
            print(f"check bits={bits} B={B}: max err {err:.3g}", flush=True)
            del t, out, ref
        except Exception as e:  # report and go on to the timings
            records.append(base | {"metric": "max_abs_err_vs_ref", "bits": bits, "error": repr(e)[:500]})
            print("check failed", repr(e)[:500], flush=True)
        save()
        torch.cuda.empty_cache()

    for S, B in ((4096, 1), (4096, 16), (32768, 1), (32768, 16), (131072, 1)):
        rec = base | {"context": S, "batch": B}
        try:
            layers = [make_layer(B, S, 2) for _ in range(LAYERS)]
            q = torch.randn(B, H, D, device="cuda").half()
            step_bytes = sum(nbytes(t) for t in layers)
            ts = time_step(lambda layers=layers, q=q: [kv_decode_attention(*args_of(t, q), bits=2, block=BLOCK)
                                                       for t in layers], a.reps)
            rec |= stats(ts) | {"bytes_per_step": step_bytes,
                                "GBps": step_bytes / (statistics.median(ts) / 1e3) / 1e9}
            rec["pct_of_copy_bw"] = 100 * rec["GBps"] / bw
            rec["floor_ms"] = step_bytes / (bw * 1e9) * 1e3
            rec["pct_of_floor"] = 100 * rec["floor_ms"] / rec["ms_median"]
            del layers
            torch.cuda.empty_cache()
            # peer: SDPA on an fp16 cache, same shapes, 32 layers' separate buffers
            kv = [(torch.randn(B, K, S + WIN, D, device="cuda").half(), torch.randn(B, K, S + WIN, D,
                   device="cuda").half()) for _ in range(LAYERS)]
            q4 = q[:, :, None]
            peer = {"bytes_per_step": sum(2 * k.numel() * 2 for k, _ in kv)}
            for name, backends in (("flash", [torch.nn.attention.SDPBackend.FLASH_ATTENTION]), ("default", None)):
                try:
                    def run(backends=backends, kv=kv, q4=q4):
                        if backends is None:
                            return [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in kv]
                        with torch.nn.attention.sdpa_kernel(backends):
                            return [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in kv]
                    pts = time_step(run, a.reps)
                    peer[f"sdpa_{name}"] = stats(pts) | {
                        "GBps": peer["bytes_per_step"] / (statistics.median(pts) / 1e3) / 1e9}
                except Exception as e:
                    peer[f"sdpa_{name}"] = {"error": repr(e)[:300]}
            rec["peer"] = peer
            ok = [p["ms_median"] for p in peer.values() if isinstance(p, dict) and "ms_median" in p]
            if ok:
                rec["speedup_vs_best_sdpa"] = min(ok) / rec["ms_median"]
            del kv
        except Exception as e:
            rec["error"] = repr(e)[:500]
        torch.cuda.empty_cache()
        records.append(rec)
        save()
        print(json.dumps({k: rec.get(k) for k in ("context", "batch", "ms_median", "GBps", "pct_of_copy_bw",
                                                  "speedup_vs_best_sdpa", "error")}), flush=True)
    save()


if __name__ == "__main__":
    main()
