"""SASS instructions per 2-bit code in the Gluon decode-attention loop (issue 31), on a machine without a GPU:
compiles moec/kernels/gluon_kv_attention.py's kernels for sm_90 (moec/kernels/aot.py) and counts the
instructions of the history loop (the innermost loop holding the code mask) per code a thread handles
(K and V: 2 · 128 · T / 32 per tile), with registers and spills, for the default launch and its variants.

    python3 -m benchmarks.studies.gluon_sass
"""
from __future__ import annotations

from moec.kernels import aot, launch_config
from moec.kernels import gluon_kv_attention as gka

TYPES = {n: "*fp32" for n in ("ks_ptr", "klev_ptr", "vlev_ptr", "part_ptr")} | {
    "q_ptr": "*fp16", "kc_ptr": "*i32", "vc_ptr": "*i32", "vs_ptr": "*fp16", "hlen_ptr": "*i32", "wk_ptr": "*fp16",
    "wv_ptr": "*fp16", "wlen_ptr": "*i32", "qscale": "fp32"} | {
    n: "i32" for n in ("H", "K", "S", "WC", "n_splits", "tiles_per_split", "win_splits")}


def main():
    cfg = launch_config.defaults()["kv_decode_attention"]["gluon"]
    for T, prefetch, maxnreg, G in ((cfg["block_t"], cfg["prefetch"], cfg["maxnreg"], 4),
                                    (cfg["block_t"], cfg["prefetch"], cfg["maxnreg"], 8),
                                    (cfg["block_t"], False, cfg["maxnreg"], 4), (64, True, None, 4)):
        kernel = gka._gluon_kv_attention_kernel
        cx = {"D": 128, "G": G, "T": T, "WCHUNK": cfg["win_chunk"],
              "PREFETCH": prefetch}
        k = aot.compile_cuda(kernel, TYPES, cx, num_warps=1, maxnreg=maxnreg)
        res = aot.resources(k.asm["cubin"])
        loop = aot.loop_histogram(aot.sass(k.asm["cubin"]), "0x3030303")
        codes = 2 * 128 * T / 32
        n = sum(loop.values())
        top = ", ".join(f"{op} {c}" for op, c in loop.most_common(8))
        print(f"T={T} prefetch={prefetch} maxnreg={maxnreg} G={G}: {res['registers']} registers, "
              f"stack {res['stack']} B; loop {n} instructions = {n / codes:.2f} per code ({top})")
    from moec.kernels import gluon_kv_attention_wg as wg

    cx = {"D": 128, "G": 4, "T": cfg["block_t"], "CENTER": True, "BIAS": True, "WCHUNK": 128,
          "PREFETCH": cfg["prefetch"]}
    types = TYPES | {"kcen_ptr": "*fp32", "kerr_ptr": "*fp32"}
    k = aot.compile_cuda(wg._gluon_kv_attention_wg_kernel, types, cx, num_warps=wg.W.value, maxnreg=cfg["maxnreg_wg"])
    res = aot.resources(k.asm["cubin"])
    loop = aot.loop_histogram(aot.sass(k.asm["cubin"]), "0x3030303")
    n = sum(loop.values())
    print(f"warp-group ({wg.W.value} warps) G=4: {res['registers']} registers, stack {res['stack']} B; loop {n} "
          f"instructions = {n / (2 * 128 * cfg['block_t'] / 32):.2f} per code per warp")


if __name__ == "__main__":
    main()
