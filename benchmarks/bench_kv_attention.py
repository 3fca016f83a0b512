"""Decode attention speed on the GPU: fused nuq-outlier kernel (2-bit history + sparse outliers + fp16
window) vs torch SDPA on an fp16 cache, Mixtral-8x7B attention shape (32 q heads, 8 KV heads, d 128).
The grid times moec/recipes/ablations/kv-nuq2-outlier.yaml as it runs (its outlier fraction, key centers, and pre-RoPE
keys rotated in the kernel or post-RoPE keys, read from the recipe); the 32k batch-16 row also times
pre-RoPE keys (rotated in registers), no centers with 1% outliers (the first kernel's configuration),
no outliers, and 3-bit codes.

One "step" = attention of one query token per sequence over 32 layers' separate cache buffers (so a
layer's cache is not served from L2 by the previous iteration), timed with CUDA events, median of
--reps after warm-up. Achieved GB/s = bytes the kernel must read (packed codes, value scales,
outlier indices and residuals, fp16 window, key channel scales, q) / time. Copy bandwidth: a 4 GiB
device-to-device copy (read + write counted), measured in the same run. Also: kernel vs the torch
reference at full size (32k context, 2- and 3-bit) with the max error, the cost of the outliers
(1% vs none) and of 3-bit codes at 32k batch 16, KV bytes per token for each codec and the largest
batch that fits at 128k on this GPU (KV cache only, no weights).

    python3 -m benchmarks.bench_kv_attention --out benchmarks/results/kv_attention_h200.json   (~25 s on the H200)
    python3 -m benchmarks.bench_kv_attention --sweep --out $OUT/sweep.json   (launch-knob sweep, ~25 s)
    python3 -m benchmarks.bench_kv_attention --config-from $OUT/sweep.json --out ...   (grid at the sweep's best)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from benchmarks.benchutil import ROOT, copy_bandwidth, stats, time_step
from moec.atomic import write_json
from moec.kernels import kv_decode_attention as kda
from moec.kernels.kv_decode_attention import kv_decode_attention, kv_decode_attention_ref

H, K, D, LAYERS, BLOCK, WIN = 32, 8, 128, 32, 32, 128 + 4 + 16  # window: 4 sinks + 128 recent + a partial block
# --recipe: e.g. moec/recipes/kv-nuq2-rot.yaml
RECIPE = ROOT / "moec" / "recipes" / "ablations" / "kv-nuq2-outlier.yaml"


def use_recipe(path: Path) -> None:
    """The outlier fraction, key centers and RoPE placement the grid times, from a nuq-outlier recipe."""
    global RECIPE, FRAC, PRE_ROPE, CENTER
    kv = yaml.safe_load(path.read_text())["kv"]
    RECIPE, FRAC = path, float(kv["outlier_frac"])
    PRE_ROPE, CENTER = kv.get("rope") == "pre", bool(kv.get("k_center", False))


use_recipe(RECIPE)


def recipe_kw(t, pre_rope: bool | None = None) -> dict:
    """The recipe's kernel options for one layer: key centers; pre-RoPE keys (Mixtral rope_theta 1e6)."""
    pre_rope = PRE_ROPE if pre_rope is None else pre_rope
    kw = {"k_center": t["k_center"]} if CENTER else {}
    if pre_rope:
        kw["rope"] = (1.0 / 1e6 ** (torch.arange(0, D, 2, device=t["k_scale"].device).float() / D), 4)
    return kw
GRID = ((4096, 1), (4096, 16), (32768, 1), (32768, 16), (131072, 1))


def make_layer(B, S, bits, frac=None, dev="cuda"):
    """Random packed history of S tokens (codes uniform over all bytes: every level appears) + window."""
    frac = FRAC if frac is None else frac
    NB = S // BLOCK
    nout = math.ceil(frac * BLOCK * D - 1e-9) if frac > 0 else 0
    dw = D * bits // 8
    return {
        "k_codes": torch.randint(0, 256, (B, K, S, dw), dtype=torch.uint8, device=dev),
        "v_codes": torch.randint(0, 256, (B, K, S, dw), dtype=torch.uint8, device=dev),
        "k_scale": torch.rand(K, D, device=dev) + 0.5,
        "k_center": torch.randn(K, D, device=dev) * 0.3,
        "v_scale": (torch.rand(B, K, S, device=dev) + 0.5).half(),
        "k_lev": torch.linspace(-1, 1, 2**bits, device=dev) ** 3,  # non-uniform
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


ORDER = ("k_codes", "v_codes", "k_scale", "v_scale", "k_lev", "v_lev", "k_oidx", "k_oval", "v_oidx", "v_oval",
         "hist_len", "win_k", "win_v", "win_len")


def args_of(t, q):
    return (q, *(t[n] for n in ORDER))


def nbytes(t, q) -> int:
    return sum(x.numel() * x.element_size() for x in t.values()) + q.numel() * q.element_size()


def time_kernel(layers, q, bits, reps, recipe=True, pre_rope: bool | None = None, **kw):
    """Median step time (32 layers) and GB/s for one launch configuration (recipe: its rope and centers)."""
    step_bytes = sum(nbytes(t, q) for t in layers)
    if not (recipe and CENTER):
        step_bytes -= sum(t["k_center"].numel() * 4 for t in layers)
    kws = [(recipe_kw(t, pre_rope) if recipe else {}) | kw for t in layers]
    ts = time_step(lambda: [kv_decode_attention(*args_of(t, q), bits=bits, block=BLOCK, **k)
                            for t, k in zip(layers, kws, strict=True)], reps)
    ms = statistics.median(ts)
    return stats(ts) | {"bytes_per_step": step_bytes, "GBps": step_bytes / (ms / 1e3) / 1e9}


def bytes_per_token() -> dict[str, float]:
    """KV bytes per token per layer (Mixtral shape) from each codec's stored fields; history blocks only."""
    from moec.runtime.kivi import KIVICodec
    from moec.runtime.nuq import FIXED_LEVELS, NUQOutlierCodec

    out = {"fp16": 2.0 * K * D * 2}
    codecs = {"kivi-2": KIVICodec(2, D, 32), "kivi-4": KIVICodec(4, D, 32)}
    for bits in (2, 3):
        lev = torch.tensor(FIXED_LEVELS[bits])
        codecs[f"nuq{bits}-outlier"] = NUQOutlierCodec(bits, D, BLOCK, lev, lev, torch.ones(K, D),
                                                       FRAC if bits == 2 else 0.01)  # the recipes
    for name, c in codecs.items():
        n = 0.0
        for kind in "kv":
            for _, (axis, trail, dtype) in c.fields(kind).items():
                elem = math.prod(trail) * torch.empty(0, dtype=dtype).element_size()
                n += K * elem / (1 if axis == "token" else BLOCK)
        out[name] = n
    return out


def time_quantize_pack(base, records, save):
    """The quantize-and-pack kernel on one block leaving the window, all batch rows and KV heads of a layer."""
    from moec.kernels.kv_quantize_pack import kv_quantize_pack
    from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec

    for bits, B in ((2, 1), (2, 16), (3, 16)):
        rec = base | {"metric": "quantize_pack_block", "bits": bits, "batch": B, "block": BLOCK, "outlier_frac": FRAC,
                      "codec": "NUQCenteredCodec (centers, query-weighted key outliers)"}
        try:
            lev = torch.tensor(FIXED_LEVELS[bits])
            codec = NUQCenteredCodec(bits, D, BLOCK, lev, lev, torch.rand(K, D) + 0.5, FRAC, torch.randn(K, D) * 0.3,
                                     torch.rand(K, D) + 0.1)
            x = torch.randn(B, K, BLOCK, D, device="cuda").half()
            ref = {kind: codec.encode(x.float(), kind) for kind in "kv"}
            view = codec.kernel_view(x.device)
            same = all(torch.equal(kv_quantize_pack(x, kind, view)[n], t)
                       for kind in "kv" for n, t in ref[kind].items())
            ts = time_step(lambda x=x, view=view: [kv_quantize_pack(x, kind, view) for kind in "kv"], 50)
            tt = time_step(lambda x=x, codec=codec: [codec.encode(x.float(), kind) for kind in "kv"], 20)
            rec |= {"ms_median_k_and_v": statistics.median(ts), "torch_encode_ms_median": statistics.median(tt),
                    "identical_to_codec": same}
        except Exception as e:
            rec["error"] = repr(e)[:400]
        records.append(rec)
        save()
        print(json.dumps({k: rec.get(k) for k in ("bits", "batch", "ms_median_k_and_v", "torch_encode_ms_median",
                                                  "identical_to_codec", "error")}), flush=True)


def check_errors(base, records, save):
    """Kernel vs reference at full size: one layer, 32k context, ragged rows."""
    for bits, B in ((2, 16), (3, 2)):
        try:
            t = make_layer(B, 32768, bits)
            t["hist_len"][0] = 32768 - 5 * BLOCK  # one row with a shorter history
            t["win_len"][-1] = 37
            q = torch.randn(B, H, D, device="cuda").half()
            out = kv_decode_attention(*args_of(t, q), bits=bits, block=BLOCK, **recipe_kw(t))
            ref = kv_decode_attention_ref(*args_of(t, q), bits=bits, block=BLOCK, **recipe_kw(t))
            err = (out - ref).abs().max().item()
            rel = ((out - ref).norm() / ref.norm()).item()
            records.append(base | {"metric": "max_abs_err_vs_ref", "bits": bits, "context": 32768, "batch": B,
                                   "value": err, "rel_l2_err": rel, "ref_absmax": ref.abs().max().item(),
                                   "pass": bool(rel < 3e-3 and math.isfinite(err)), "dot_precision": "fp16"})
            print(f"check bits={bits} B={B}: max err {err:.3g}, rel {rel:.3g}", flush=True)
            del t, out, ref
        except Exception as e:  # report and go on to the timings
            records.append(base | {"metric": "max_abs_err_vs_ref", "bits": bits, "error": repr(e)[:500]})
            print("check failed", repr(e)[:500], flush=True)
        save()
        torch.cuda.empty_cache()


def _guard(fn, *args, **kw):
    """One optional measurement: its result, or the error (the rest of the record still counts)."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        return {"error": repr(e)[:400]}


def run_grid(base, records, save, bw, reps):
    for S, B in GRID:
        rec = base | {"metric": "decode_attention_step", "context": S, "batch": B, "bits": 2, "outlier_frac": FRAC,
                      "rope": "pre (rotated in the kernel)" if PRE_ROPE else "post", "k_center": CENTER,
                      "config": dict(kda.CONFIG)}
        try:
            layers = [make_layer(B, S, 2) for _ in range(LAYERS)]
            q = torch.randn(B, H, D, device="cuda").half()
            rec |= time_kernel(layers, q, 2, reps)
            rec["pct_of_copy_bw"] = 100 * rec["GBps"] / bw
            rec["floor_ms"] = rec["bytes_per_step"] / (bw * 1e9) * 1e3
            if S == 32768 and B == 16:  # what pre-RoPE keys, the outliers and 3-bit codes cost
                rec["pre_rope" if not PRE_ROPE else "post_rope"] = _guard(time_kernel, layers, q, 2, reps,
                                                                          pre_rope=not PRE_ROPE)
                del layers
                torch.cuda.empty_cache()
                layers = [make_layer(B, S, 2, frac=0.01) for _ in range(LAYERS)]
                rec["post_rope_no_center_frac001"] = _guard(time_kernel, layers, q, 2, reps, recipe=False)
                del layers
                torch.cuda.empty_cache()
                layers = [make_layer(B, S, 2, frac=0.0) for _ in range(LAYERS)]
                rec["no_outliers"] = _guard(time_kernel, layers, q, 2, reps)
                del layers
                torch.cuda.empty_cache()
                layers = [make_layer(B, S, 3) for _ in range(LAYERS)]
                rec["bits3"] = _guard(time_kernel, layers, q, 3, reps)
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
                    pts = time_step(run, reps)
                    peer[f"sdpa_{name}"] = stats(pts) | {
                        "GBps": peer["bytes_per_step"] / (statistics.median(pts) / 1e3) / 1e9}
                except Exception as e:
                    peer[f"sdpa_{name}"] = {"error": repr(e)[:300]}
            rec["peer"] = peer
            if "ms_median" in peer["sdpa_flash"]:
                rec["speedup_vs_sdpa_flash"] = peer["sdpa_flash"]["ms_median"] / rec["ms_median"]
            ok = [p["ms_median"] for p in peer.values() if isinstance(p, dict) and "ms_median" in p]
            if ok:
                rec["speedup_vs_best_sdpa"] = min(ok) / rec["ms_median"]
            del kv
        except Exception as e:
            rec["error"] = repr(e)[:500]
            traceback.print_exc()
        torch.cuda.empty_cache()
        records.append(rec)
        save()
        print(json.dumps({k: rec.get(k) for k in ("context", "batch", "ms_median", "GBps", "pct_of_copy_bw",
                                                  "speedup_vs_sdpa_flash")}), flush=True)


def run_sweep(base, records, save, reps):
    """Launch knobs at the target shapes (32k batch 16 and batch 1); one record per configuration."""
    knobs = [dict(out_mode=m, block_t=bt, num_warps=4) for m in (0, 1, 2) for bt in (32, 64)]
    knobs += [dict(out_mode=m, block_t=128, num_warps=8) for m in (1, 2)] + [dict(out_mode=2, block_t=64, num_warps=8)]
    b1 = [dict(waves=w, block_t=bt) for w in (4, 8, 16, 32) for bt in (32, 64)]
    # an outlier count that is a power of two (1/128 of a 32 x 128 block: 32, against 33 padded to 64)
    p2 = [dict()]
    for S, B, frac, kset in ((32768, 16, 1 / 128, p2), (32768, 1, 1 / 128, p2), (32768, 16, FRAC, knobs),
                             (32768, 1, FRAC, b1), (4096, 1, FRAC, b1)):
        layers = [make_layer(B, S, 2, frac=frac) for _ in range(LAYERS)]
        q = torch.randn(B, H, D, device="cuda").half()
        for kw in kset:
            rec = base | {"metric": "sweep", "context": S, "batch": B, "outlier_frac": frac, "knobs": kw}
            try:
                rec |= time_kernel(layers, q, 2, reps, **kw)
                k = kda._LAST.get("kernel")
                rec |= {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None)}
            except Exception as e:
                rec["error"] = repr(e)[:400]
            records.append(rec)
            save()
            print(S, B, frac, kw, round(rec.get("ms_median", -1), 3), round(rec.get("GBps", -1)),
                  rec.get("n_regs"), rec.get("n_spills"), rec.get("error", ""), flush=True)
        del layers
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="the nuq-outlier recipe whose codec the grid times")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="sweep launch knobs instead of the target grid")
    ap.add_argument("--config-from", type=Path, help="a --sweep result: launch with its fastest 32k batch-16 knobs")
    a = ap.parse_args()
    use_recipe(a.recipe)
    if a.config_from:
        sweep = [r for r in json.loads(a.config_from.read_text()) if r.get("context") == 32768
                 and r.get("batch") == 16 and "ms_median" in r]
        if sweep:
            kda.CONFIG.update(min(sweep, key=lambda r: r["ms_median"])["knobs"])
            print("config", kda.CONFIG, flush=True)
    t0 = time.time()
    dev = torch.cuda.get_device_name(0)
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or None
    base = {"bench": "kv_attention", "git_sha": sha, "date": time.strftime("%Y-%m-%d"), "device": dev,
            "shape": f"mixtral-8x7b attention: {H} q heads, {K} KV heads, head_dim {D}, {LAYERS} layers",
            "method": "nuq-outlier 2-bit fused decode attention", "recipe": RECIPE.stem}
    records = []

    def save():
        write_json(a.out, records)

    if a.sweep:
        run_sweep(base, records, save, a.reps)
        print(f"sweep done in {time.time() - t0:.0f} s")
        return
    bw = copy_bandwidth()
    records.append(base | {"metric": "copy_bandwidth_GBps", "value": bw})
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    bpt = bytes_per_token()
    free_total = torch.cuda.get_device_properties(0).total_memory
    for name, n in bpt.items():
        per_seq = n * LAYERS * 131072
        records.append(base | {"metric": "kv_bytes_per_token", "codec": name, "bytes_per_token_per_layer": n,
                               "bytes_per_token_all_layers": n * LAYERS, "bits_per_element": 8 * n / (2 * K * D),
                               "max_batch_128k": int(free_total // per_seq),
                               "note": "history blocks; the fp16 window adds (sinks + window) fp16 tokens per "
                                       "sequence; max batch = GPU memory / (bytes per token · 32 layers · 131072), "
                                       "KV only"})
    save()
    check_errors(base, records, save)
    time_quantize_pack(base, records, save)
    run_grid(base, records, save, bw, a.reps)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    save()


if __name__ == "__main__":
    main()
