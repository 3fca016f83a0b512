"""Which tensor-core instruction an e4m3 product becomes on sm_90 under Triton 3.6, `tl` against Gluon (issue 35).

    python3 -m benchmarks.studies.fp8_mma_probe          # CPU: compiles for sm_90, needs no GPU

The 2-bit latent kernel's e4m3 design (docs/results.md, "Next for the latent kernel: e4m3 products") turns four
codes into four e4m3 levels with one byte permute of a 4-entry table; that only pays if the products then run as
e4m3 mma (m16n8k32), whose operand register holds exactly four consecutive k elements. Two probes, each compiled for
sm_90 and its PTX searched for mma instructions:
  tl     a `tl` kernel with the decode tile's shapes (16 heads x 128 channels · 128 channels x 32 tokens, then P · the
         tile), both operands e4m3 (the tile made by the prmt lookup, as the design would);
  gluon  a Gluon kernel calling mma_v2 on e4m3 operands in dot-operand layouts of k_width 4.
Found (2026-12-07): `tl` lowers the e4m3 dots at M = 16 to f16 mma.sync m16n8k16 (the operands converted to f16
first: no e4m3 tensor-core rate, a conversion per two elements on top), Gluon's mma_v2 to mma.sync m16n8k32 e4m3.
So the design needs Gluon (`benchmarks/studies/gluon_mla_nuq.py` holds the fp16 version to convert).
"""

from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from moec.kernels import aot


@triton.jit
def _levels_e4m3(codes, table, K: tl.constexpr):
    """Plane K of packed 2-bit codes (uint8, four planes a byte) as e4m3 levels: `table` holds the 4 levels' bytes
    repeated along the last axis, so the four elements one asm instance packs are the whole table."""
    if K == 0:
        SH: tl.constexpr = "0"
    elif K == 1:
        SH: tl.constexpr = "2"
    elif K == 2:
        SH: tl.constexpr = "4"
    else:
        SH: tl.constexpr = "6"
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u; shr.b32 t, $1, " + SH + "; and.b32 t, t, 0x03030303; prmt.b32 t, t, 0, 0x3120; "
        "shr.b32 u, t, 12; or.b32 t, t, u; prmt.b32 $0, $2, 0, t; }",
        "=r,r,r", [codes, table], dtype=tl.uint8, is_pure=True, pack=4).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _tl_probe(q_ptr, c_ptr, lv_ptr, o_ptr, H: tl.constexpr, N: tl.constexpr, C: tl.constexpr):
    q = tl.load(q_ptr + tl.arange(0, H)[:, None] * C + tl.arange(0, C)[None, :]).to(tl.float8e4nv)
    codes = tl.load(c_ptr + tl.arange(0, N)[:, None] * C + tl.arange(0, C)[None, :])
    table = tl.load(lv_ptr + tl.arange(0, C) % 4)[None, :] + tl.zeros((N, C), tl.uint8)
    tile = _levels_e4m3(codes, table, 1)
    s = tl.dot(q, tl.trans(tile))  # [H, N]
    o = tl.dot(s.to(tl.float8e4nv), tile)  # [H, C]
    tl.store(o_ptr + tl.arange(0, H)[:, None] * C + tl.arange(0, C)[None, :], o)


@gluon.jit
def _gluon_probe(a_ptr, b_ptr, o_ptr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    ra = gl.arange(0, 64, layout=gl.SliceLayout(1, A_L))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, A_L))
    a = gl.load(a_ptr + ra[:, None] * 32 + ka[None, :])
    kb = gl.arange(0, 32, layout=gl.SliceLayout(1, B_L))
    nb = gl.arange(0, 16, layout=gl.SliceLayout(0, B_L))
    b = gl.load(b_ptr + kb[:, None] * 16 + nb[None, :])
    acc = mma_v2(a, b, gl.zeros([64, 16], gl.float32, MMA))
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    no = gl.arange(0, 16, layout=gl.SliceLayout(0, MMA))
    gl.store(o_ptr + ro[:, None] * 16 + no[None, :], acc)


def mma_instructions(compiled) -> list[str]:
    return sorted(set(re.findall(r"mma\.sync\.aligned\.[\w.]+", compiled.asm["ptx"])))


def main() -> int:
    tl_k = aot.compile_cuda(_tl_probe, {"q_ptr": "*fp32", "c_ptr": "*u8", "lv_ptr": "*u8", "o_ptr": "*fp32"},
                            {"H": 16, "N": 32, "C": 128}, 4)
    gl_k = aot.compile_cuda(_gluon_probe, {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "o_ptr": "*fp32"}, {}, 4)
    print(f"triton {triton.__version__}, sm_90")
    print("tl e4m3 dots (M = 16):", ", ".join(mma_instructions(tl_k)))
    print("gluon mma_v2 on e4m3 (k_width 4):", ", ".join(mma_instructions(gl_k)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
