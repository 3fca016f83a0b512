"""Speed of the fused latent decode attention (moec/kernels/latent_decode_attention.py) at the Mixtral-8x7B
attention shape (32 query heads, 8 KV heads, head_dim 128), contexts 4k / 32k / 128k, batch 1 and 16,
against torch SDPA on the fp16 cache of the same context.

Latent: ranks RK = RV = 256 of the 1024 = 8·128 key (value) dims of a layer, at 4 bits (16x fewer bytes
than the fp16 cache) and at 16 bits (4x); fp16 window of 128 tokens. Each call is timed with
triton.testing.do_bench, which flushes the L2 cache (a 256 MB write) before every timed call, so one
layer's cache never sits in the 60 MB L2 (docs/benchmarks.md, "Speed"); median, p10, p90 over its repetitions.
Achieved GB/s = bytes the call must read (latent codes or fp16 K/V, window, q) / median time; the
device-to-device copy bandwidth (≥ 4 GB, read + write) is measured in the same run. TFLOP/s = the
kernel's dot products (2·B·S·H·(RK + RV)) / time: with all 32 heads sharing one latent the history is
~128 flop per byte at 4 bits, near the H200's tf32 ridge, so the kernel can be compute-bound.
Every config is measured on its own; a failing config is recorded with its error and the run goes on.

Variants (all rank 256, fp16 window of 128):
  post        post-RoPE keys, 4-bit latent, no residual (the absorbed MLA-style path)
  post-res    + seed 000's sparse fp16 residual: 0.5% of each 32-token block's 32·1024 elements (164
              entries for keys and for values, int16 index + fp16 value)
  pre-res     pre-RoPE keys rebuilt per KV head and rotated in registers, + the residual: the shipped
              kv-latent-head recipe's kind; 2·d·RK flops per token and KV head on top
  post-b16    fp16 latent, no residual
--sweep first times launch configurations (tile, fp16 dot operands, warps, programs per step) for each
variant at 32k, batch 16 and batch 1, and the grid then runs each variant with its fastest one.

    python3 -m benchmarks.bench_latent_attention --out benchmarks/results/latent_attention_h200.json
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_latent_attention --device cpu --tiny --out /tmp/x.json
(--tiny: small shapes, checks the kernel against the reference, CPU times are not speed numbers.)
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moec.cli.common import base_record, write_json_atomic
from moec.formats.bitpack import pack_planar
from moec.kernels.latent_decode_attention import (
    CONFIG,
    latent_decode_attention,
    latent_decode_attention_ref,
    latent_statics,
)

ROOT = Path(__file__).resolve().parents[1]


def make_inputs(B, H, K, d, R, S, Wc, bits, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dev)

    u_k, u_v = rnd(K, d, R) / R**0.5, rnd(K, d, R) / R**0.5
    mean_k, mean_v = rnd(K, d) * 0.1, rnd(K, d) * 0.1
    if bits == 16:
        ck = torch.randn(B, S, R, device=dev, dtype=torch.float16)
        cv = torch.randn(B, S, R, device=dev, dtype=torch.float16)
        sk = sv = torch.ones(R, device=dev)
    else:
        ck = pack_planar(torch.randint(0, 2**bits, (B, S, R), device=dev), bits)
        cv = pack_planar(torch.randint(0, 2**bits, (B, S, R), device=dev), bits)
        sk = sv = torch.full((R,), 0.3, device=dev)
    wk = torch.randn(B, K, Wc, d, device=dev, dtype=torch.float16)
    wv = torch.randn(B, K, Wc, d, device=dev, dtype=torch.float16)
    q = torch.randn(B, H, d, device=dev, dtype=torch.float16)
    hist = torch.full((B,), S, dtype=torch.int32, device=dev)
    win = torch.full((B,), Wc, dtype=torch.int32, device=dev)
    return [q, ck, cv, u_k, mean_k, sk, u_v, mean_v, sv, bits, hist, wk, wv, win]


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def bench(fn, dev, tiny: bool):
    """(median, p10, p90) ms."""
    if tiny or dev == "cpu":
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
        ts.sort()
        return ts[1], ts[0], ts[-1]
    from triton.testing import do_bench

    q = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.1, 0.9])
    return tuple(q)


def copy_bandwidth(dev) -> float:
    """GB/s of a device-to-device copy of 4 GiB (read + write counted)."""
    n = 1 << 31  # fp16 elements: 4 GiB
    a = torch.empty(n, dtype=torch.float16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    del a, b
    return 2 * n * 2 / (ts[len(ts) // 2] * 1e-3) / 1e9


VARIANTS = {"post": (4, False, False), "post-res": (4, True, False), "pre-res": (4, True, True),
            "post-b16": (16, False, False)}
N_OUT, BLOCK = 164, 32  # ceil(0.005 · 32 · 1024) residual entries per block, kind


def variant_kwargs(name, B, K, d, S, dev, seed=1):
    """The sparse residual and RoPE table of a variant (kernel keyword arguments)."""
    _bits, res, pre = VARIANTS[name]
    kw = {}
    if res:
        g = torch.Generator(device="cpu").manual_seed(seed)
        nb, DG = S // BLOCK, K * d
        for kind in "kv":
            idx = torch.randint(0, BLOCK * DG, (B, nb, N_OUT), generator=g, dtype=torch.int32).to(torch.int16)
            kw[f"{kind}_out"] = (idx.to(dev), (torch.randn(B, nb, N_OUT, generator=g) * 0.5).half().to(dev))
        kw.update(block=BLOCK, group_dim=DG, layer_off=0)
    if pre:
        kw["rope"] = ((1.0 / 1e6 ** (torch.arange(0, d, 2).float() / d)).to(dev), 4)
    return kw


def flops(name, B, H, K, d, R, S, Wc) -> float:
    f = 2 * B * S * H * (2 * R) + 4 * B * H * Wc * d
    if VARIANTS[name][2]:  # pre-RoPE: rebuild keys (2·d·R per token and KV head), then scores in d-space
        f += 2 * B * S * K * d * R + 2 * B * S * H * d - 2 * B * S * H * R
    return f


def sweep_configs(tiny: bool) -> list[dict]:
    if tiny:
        return [{"block": 32}, {"block": 64, "programs": 4}]
    # fp16 dot operands won every batch-16 point of the first sweep (tf32: up to 3x slower), so only
    # tiles and warps are swept
    return [{"block": block, "fp16": True, "warps_post": warps, "warps_pre": warps}
            for block in (32, 64) for warps in (4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU check under TRITON_INTERPRET=1")
    ap.add_argument("--sweep", action="store_true", help="time launch configs first, run the grid with the best")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="default 4k, 32k, 128k")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    dev = a.device
    if a.tiny:
        H, K, d, R, Wc, contexts, batches = 4, 2, 32, 16, 7, (64, 96), (1, 2)
    else:
        H, K, d, R, Wc, contexts, batches = 32, 8, 128, 256, 128, (4096, 32768, 131072), (1, 16)
    contexts = a.contexts or contexts
    t_start = time.time()
    records = []
    copy_gbs = None
    if dev.startswith("cuda") and not a.tiny:
        try:
            copy_gbs = copy_bandwidth(dev)
            print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
            print(f"copy bandwidth failed: {e!r}", flush=True)
    shape = f"mixtral-8x7b attention (H={H}, K={K}, d={d})" if not a.tiny else f"tiny (H={H}, K={K}, d={d})"
    timing = "do_bench, L2 flushed before each call" if not a.tiny else "CPU interpreter (not speed)"

    def measure(name, S, B, config, check):
        bits = VARIANTS[name][0]
        args = make_inputs(B, H, K, d, R, S, Wc, bits, dev)
        kw = variant_kwargs(name, B, K, d, S, dev)
        # the codec's per-layer forms made once, as LatentKVCache does (LatentKVCache._kernel_layer)
        statics = latent_statics(*args[3:10], H // K, VARIANTS[name][2], config)
        fn = functools.partial(latent_decode_attention, *args, config=config, statics=statics, **kw)
        rec = {}
        if check:  # correctness at this size before timing it
            ref = latent_decode_attention_ref(*args, **kw)
            err = (fn() - ref).abs().max().item()
            rec["max_abs_err_vs_ref"] = err
            assert err < 5e-3 * max(1.0, ref.abs().max().item()), err
        ms = bench(fn, dev, a.tiny)
        q, ck, cv, *_ = args
        byt = nbytes(q, ck, cv, args[11], args[12], *(t for k in ("k_out", "v_out") if k in kw for t in kw[k]))
        f = flops(name, B, H, K, d, R, S, Wc)
        rec.update(ms_median=ms[0], ms_p10=ms[1], ms_p90=ms[2], bytes_per_step=byt,
                   gb_s=byt / (ms[0] * 1e-3) / 1e9, tflop_s=f / (ms[0] * 1e-3) / 1e12)
        del args, kw
        return rec

    best = {}
    if a.sweep:
        S = contexts[1]
        for name in a.variants:
            if name == "post-b16":  # takes the config of `post` (same kernel, other code width)
                continue
            times = {}
            for cfg in sweep_configs(a.tiny):
                tot = 0.0
                for B in batches:
                    rec = base_record("latent_attention_sweep", dev) | {"shape": shape, "context": S, "batch": B,
                                                                       "method": name, "config": cfg,
                                                                       "timing": timing}
                    try:
                        rec.update(measure(name, S, B, cfg, check=False))
                        tot += rec["ms_median"] * (1.0 if B == batches[-1] else 4.0)  # batch 1 counts 4x
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = repr(e)[:300]
                        tot = float("inf")
                    records.append(rec)
                    print({k: rec.get(k) for k in ("method", "batch", "config", "ms_median", "error")}, flush=True)
                times[tuple(sorted(cfg.items()))] = tot
            best[name] = dict(min(times, key=times.get))
            print(f"best config for {name}: {best[name]}", flush=True)
            write_json_atomic(a.out, records)

    for S in contexts:
        for B in batches:
            common = base_record("latent_attention", dev) | {
                "shape": shape, "context": S, "batch": B, "rank": R, "window": Wc, "dtype": "fp16 cache / fp32 acc",
                "timing": timing}
            # peer: SDPA on the fp16 cache of the same context
            peer = {}
            try:
                q = torch.randn(B, H, 1, d, device=dev, dtype=torch.float16)
                k = torch.randn(B, K, S + Wc, d, device=dev, dtype=torch.float16)
                v = torch.randn_like(k)
                sdpa = bench(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), dev,
                             a.tiny)
                b_sdpa = nbytes(q, k, v)
                peer = {"method": "torch SDPA, fp16 cache", "ms_median": sdpa[0], "ms_p10": sdpa[1],
                        "ms_p90": sdpa[2], "bytes_per_step": b_sdpa, "gb_s": b_sdpa / (sdpa[0] * 1e-3) / 1e9}
                del q, k, v
            except Exception as e:  # noqa: BLE001
                peer = {"method": "torch SDPA, fp16 cache", "error": repr(e)}
            for name in a.variants:
                cfg = best.get(name, best.get("post", {}) if name == "post-b16" else {})
                rec = dict(common, method=name, variant=name, bits=VARIANTS[name][0], peer=peer,
                           config=CONFIG | cfg)
                try:
                    rec.update(measure(name, S, B, cfg, check=a.tiny or (S <= 4096 and B == 1)))
                    rec.update(fp16_cache_bytes=peer.get("bytes_per_step"),
                               speedup_vs_sdpa=(peer["ms_median"] / rec["ms_median"]) if "ms_median" in peer else None)
                    if copy_gbs:
                        rec["copy_gb_s"] = copy_gbs
                        rec["pct_of_copy_bw"] = 100 * rec["gb_s"] / copy_gbs
                        rec["floor_ms"] = rec["bytes_per_step"] / (copy_gbs * 1e9) * 1e3
                        rec["pct_of_floor"] = 100 * rec["floor_ms"] / rec["ms_median"]
                except Exception as e:  # noqa: BLE001 - one failing config must not lose the run
                    rec["error"] = repr(e)[:300]
                records.append(rec)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                       if k in ("context", "batch", "method", "ms_median", "gb_s", "tflop_s", "speedup_vs_sdpa",
                                "error")}, flush=True)
                write_json_atomic(a.out, records)
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
    write_json_atomic(a.out, records)
    print(f"wrote {a.out} in {time.time() - t_start:.0f}s ({math.fsum(1 for r in records if 'error' in r)} errors)")


if __name__ == "__main__":
    main()
