"""Feasibility probe for issue 31 on the H200 image (triton 3.6 Gluon), run before the kernel is trusted:

  1. four 2-bit codes per byte unpacked inside the tensor-core operand registers: int32 words of packed codes
     loaded in a register layout that *is* mma_v2's B-operand layout after a join/reshape/permute (checked at
     compile time: convert_layout(..., assert_trivial=True)), each word's bit field turned into fp16 levels
     by `prmt` against a register-resident four-level table (no shared memory, no table in memory);
  2. the same words feeding Hopper's warpgroup_mma as the register A operand (tokens as M = 64 over one
     warpgroup, channels as K), B (the query block) from shared memory.

Each prints its max error against torch; `--compile-only` compiles both for sm_90 on a machine without a GPU
(ptxas ships with triton) and prints registers per thread.

    python3 -m benchmarks.studies.gluon_operand_probe            (on the GPU)
    python3 -m benchmarks.studies.gluon_operand_probe --compile-only
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from moec.kernels.gluon_kv_attention import MMA, OP_A, OP_B, _key_channel, _lev_words, _unpack4

T = gl.constexpr(32)
# key words [8, T] int32 for the B operand Kᵀ (the probe's orientation; the kernel now uses K as the A operand):
# lane (c = lane % 4, n = lane / 4) holds words 2c, 2c + 1 of tokens n + 8i
KEY_WORDS = gl.constexpr(gl.BlockedLayout([2, 1], [4, 8], [1, 1], [0, 1]))


@gluon.jit
def _key_block(kw, j: gl.constexpr, tab_lo, tab_hi, T: gl.constexpr):
    """Bit field j of key words [8, T] as the B operand Kᵀ [32, T] fp16: thread (c, n) holds words r = 2c + ks of
    token n, bytes m = 2·mh + ml, which the operand wants at rows k = 16·ks + 8·mh + 2c + ml (_key_channel)."""
    e0, e1, e2, e3 = _unpack4(kw, j, tab_lo, tab_hi)
    x = gl.join(gl.join(e0, e1), gl.join(e2, e3))  # [r, T, ml, mh] (join appends the new axis last)
    x = gl.reshape(x, [4, 2, T, 2, 2])  # [c, ks, T, ml, mh]
    x = gl.reshape(gl.permute(x, [1, 4, 0, 3, 2]), [32, T])  # [ks, mh, c, ml, T]
    return gl.convert_layout(x, OP_B, assert_trivial=True)
WG = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16]))
WG_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=WG, k_width=2))
# words [64 tokens, 8 words]: lane (c, n) holds words 2c, 2c + 1 of tokens n, n + 8, warp w tokens + 16w
WG_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8]))


@gluon.jit
def mma_v2_probe(w_ptr, q_ptr, lev_ptr, out_ptr):
    """S[16, T] = Q[16, 32] · Kᵀ[32, T] for channel block j = 1 of T tokens' packed keys."""
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, KEY_WORDS))
    t = gl.arange(0, T, layout=gl.SliceLayout(0, KEY_WORDS))
    w = gl.load(w_ptr + t[None, :] * 8 + r[:, None])
    lo, hi = _lev_words(lev_ptr)
    kb = _key_block(w, 1, gl.full(w.shape, 0, gl.int32, KEY_WORDS) + lo, gl.full(w.shape, 0, gl.int32, KEY_WORDS) + hi,
                    T)
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, OP_A))
    cols = 32 + _key_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, OP_A)))
    q = gl.load(q_ptr + rows[:, None] * 128 + cols[None, :])
    s = mma_v2(q, kb, gl.zeros([16, T], gl.float32, MMA))
    orow = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, T, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + orow[:, None] * T + ocol[None, :], s)


@gluon.jit
def wgmma_probe(w_ptr, q_ptr, lev_ptr, out_ptr):
    """Sᵀ[64, 16] = K[64 tokens, 32] · Qᵀ[32, 16] for channel block j = 2: A = dequantized keys in registers."""
    t = gl.arange(0, 64, layout=gl.SliceLayout(1, WG_WORDS))
    r = gl.arange(0, 8, layout=gl.SliceLayout(0, WG_WORDS))
    w = gl.load(w_ptr + t[:, None] * 8 + r[None, :])
    lo, hi = _lev_words(lev_ptr)
    e0, e1, e2, e3 = _unpack4(w, 2, gl.full(w.shape, 0, gl.int32, WG_WORDS) + lo,
                              gl.full(w.shape, 0, gl.int32, WG_WORDS) + hi)
    x = gl.join(gl.join(e0, e1), gl.join(e2, e3))  # [t, r, ml, mh]
    x = gl.reshape(x, [64, 4, 2, 2, 2])  # [t, c, ks, ml, mh]
    x = gl.reshape(gl.permute(x, [0, 2, 4, 1, 3]), [64, 32])  # [t, ks, mh, c, ml]: k = 16ks + 8mh + 2c + ml
    a = gl.convert_layout(x, WG_A, assert_trivial=True)
    # Qᵀ [32, 16] (rows in _key_channel order) through shared memory
    LQ: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
    kk = gl.arange(0, 32, layout=gl.SliceLayout(1, LQ))
    gg = gl.arange(0, 16, layout=gl.SliceLayout(0, LQ))
    qt = gl.load(q_ptr + gg[None, :] * 128 + (64 + _key_channel(kk))[:, None])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    b = gl.allocate_shared_memory(gl.float16, [32, 16], SMEM, qt)
    fence_async_shared()
    acc = warpgroup_mma(a, b, gl.zeros([64, 16], gl.float32, WG))
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, WG))
    ocol = gl.arange(0, 16, layout=gl.SliceLayout(0, WG))
    gl.store(out_ptr + orow[:, None] * 16 + ocol[None, :], acc)


def reference(words: torch.Tensor, lev: torch.Tensor, j: int) -> torch.Tensor:
    """Levels of bit field j of every byte: [tokens, 32] (byte order = channel order within block j)."""
    b = words.view(torch.uint8).view(words.shape[0], 32).long()
    return lev[(b >> (2 * j)) & 3]


def run():
    torch.manual_seed(0)
    lev = torch.tensor([-1.3, -0.4, 0.35, 1.2], device="cuda")
    q = torch.randn(16, 128, device="cuda").half()
    w = torch.randint(-2**31, 2**31 - 1, (64, 8), dtype=torch.int32, device="cuda")
    out = torch.empty(16, 32, device="cuda")
    mma_v2_probe[(1,)](w, q, lev, out, num_warps=1)
    ref = q[:, 32:64].float() @ reference(w[:32], lev.half().float(), 1).T
    print("mma_v2, codes unpacked in operand registers, prmt table: max err", (out - ref).abs().max().item())
    out2 = torch.empty(64, 16, device="cuda")
    wgmma_probe[(1,)](w, q, lev, out2, num_warps=4)
    ref2 = reference(w, lev.half().float(), 2) @ q[:, 64:96].float().T
    print("warpgroup_mma, A = dequantized codes in registers: max err", (out2 - ref2).abs().max().item())


def compile_only():
    import os
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"w_ptr": "*i32", "q_ptr": "*fp16", "lev_ptr": "*fp32", "out_ptr": "*fp32"}
    for fn, warps in ((mma_v2_probe, 1), (wgmma_probe, 4)):
        k = triton.compile(GluonASTSource(fn=fn, signature=sig), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps})
        path = Path("/tmp") / f"{fn.__name__}.cubin"
        path.write_bytes(k.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        res = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
        print(fn.__name__, "compiled for sm_90:", re.search(r"REG:\d+", res).group(0), os.path.getsize(path), "bytes")


if __name__ == "__main__":
    compile_only() if "--compile-only" in sys.argv else run()
