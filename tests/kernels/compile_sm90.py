"""Compile the latent history kernels for sm_90 (H100/H200) on any machine: Triton's MLIR passes and
ptxas run, nothing launches. The CPU interpreter never compiles, so this is how CI catches compiler
failures. Run without TRITON_INTERPRET:  python3 -m tests.kernels.compile_sm90 post-kv"""

import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moec.kernels import latent_decode_attention as lda

POINTERS = {n: "*fp32" for n in ("qlat_ptr", "bias_ptr", "q_ptr", "kb_ptr", "inv_ptr", "m_ptr", "l_ptr", "acc_ptr",
                                 "accd_ptr")}
POINTERS |= {"uk_ptr": "*fp16", "ck_ptr": "*u8", "cv_ptr": "*u8", "hlen_ptr": "*i32", "kidx_ptr": "*i16",
             "kval_ptr": "*fp16", "vidx_ptr": "*i16", "vval_ptr": "*fp16"}


def compile_sm90(fn, consts: dict, warps: int):
    names = fn.arg_names
    sig = {n: POINTERS.get(n) or ("constexpr" if n in consts else "fp32" if n == "sm_scale" else "i32") for n in names}
    const = {(names.index(n),): v for n, v in consts.items()}
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def latent_case(case: str):
    """Mixtral attention shape (32 heads, 8 KV heads, d 128, rank 256, 4-bit, 164 residual entries per block)."""
    cfg = lda.CONFIG
    kout, vout = ("k" in case.split("-")[-1], "v" in case.split("-")[-1]) if "-" in case else (False, False)
    res = kout or vout
    consts = dict(BITS=4, RK_P2=256, RV_P2=256, BLOCK=cfg["block_res"] if res else cfg["block"], PREC="tf32",
                  DT=tl.float16, D=128, KD=1024, BLK=32, KOUT=kout, VOUT=vout, EK_P2=256, EV_P2=256)
    if case.startswith("pre"):
        return compile_sm90(lda._latent_hist_pre_kernel, consts | {"G": 4, "G_P2": 16, "RC": cfg["rank_chunk"]},
                            cfg["warps_pre"])
    return compile_sm90(lda._latent_hist_kernel, consts | {"H_P2": 32}, cfg["warps_res"] if res else cfg["warps_post"])


if __name__ == "__main__":
    for c in sys.argv[1:]:
        k = latent_case(c)
        assert k.asm.get("cubin"), c
        print(f"{c}: compiled ({len(k.asm['cubin'])} bytes of cubin)")
