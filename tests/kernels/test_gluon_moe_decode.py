"""The Gluon 2-bit hls MoE decode kernels (moec/kernels/gluon_moe_decode.py) on a machine without a GPU: Gluon has no
interpreter, so these tests compile them for sm_90 (ptxas ships with triton). What that checks: they build for the
settings the dispatch and the benchmark launch, every layout conversion declared free is free (assert_trivial fails
the compile otherwise: the codes-in-operand-registers and the x-in-operand-registers claims), no spills, and the
loop does the work it should (tensor-core MMAs, a prmt per two codes, no shared memory). Their numbers against
moe_decode_ref come from the GPU: benchmarks/gpu_smoke.py
(`(kernels)` records) and benchmarks/bench_gluon_moe.py."""

from collections import Counter

import pytest
import torch

from moec.kernels import aot
from moec.kernels import gluon_moe_decode as gmd
from moec.kernels.dequant import MODE_LUT, QWeight

GATE_UP_TYPES = {"x_ptr": "*bf16", "ids_ptr": "*i32", "wts_ptr": "*fp32", "w1_ptr": "*i32", "t1_ptr": "*i32",
                 "w3_ptr": "*i32", "t3_ptr": "*i32", "h_ptr": "*fp16", "bg_ptr": "*bf16", "bu_ptr": "*bf16", "I": "i32"}
DOWN_TYPES = {"h_ptr": "*fp16", "ids_ptr": "*i32", "wts_ptr": "*fp32", "w2_ptr": "*i32", "t2_ptr": "*i32",
              "out_ptr": "*fp32", "bd_ptr": "*bf16", "Dout": "i32"}
LOOP = "0x3030303"  # the chunk loop: the innermost loop holding the code mask
# (kernel, constexprs, warps): Mixtral's gate/up at the default, Qwen3's down (uneven: 6 chunks over 4 warps), the
# clamped SwiGLU with biases, both kernels on tile_codes' layout (its rename into the operand placement is
# assert_trivial)
CASES = [("_gate_up_kernel", {"D": 4096, "A": 2, "BM": 32, "KW": 4, "HAS_BIAS": False, "ACT": 0, "LIMIT": 7.0,
                              "TILED": False}, 4),
         ("_down_kernel", {"I": 768, "A": 8, "BM": 16, "KW": 4, "SPLIT": 1, "HAS_BIAS": True,
                           "TILED": False}, 4),
         ("_gate_up_kernel", {"D": 2048, "A": 8, "BM": 32, "KW": 4, "HAS_BIAS": True, "ACT": 1, "LIMIT": 7.0,
                              "TILED": False}, 4),
         ("_gate_up_kernel", {"D": 4096, "A": 2, "BM": 32, "KW": 4, "HAS_BIAS": False, "ACT": 0, "LIMIT": 7.0,
                              "TILED": True}, 4),
         ("_down_kernel", {"I": 768, "A": 8, "BM": 16, "KW": 4, "SPLIT": 1, "HAS_BIAS": False,
                           "TILED": True}, 4)]


@pytest.fixture(scope="module")
def reports():
    """Every compile of this file in one fresh process (aot.report_in_subprocess says why)."""
    return aot.report_in_subprocess([
        {"module": "moec.kernels.gluon_moe_decode", "kernel": k,
         "types": GATE_UP_TYPES if k == "_gate_up_kernel" else DOWN_TYPES, "constexprs": c, "num_warps": w,
         "loop_marker": LOOP} for k, c, w in CASES])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_compiles_for_sm90_without_spills(reports, case):
    kernel, c, _ = CASES[case]
    res, loop = reports[case]["resources"], Counter(reports[case]["loop"])
    assert res["local"] == 0 and res["registers"] <= 168, res
    mats = 2 if kernel == "_gate_up_kernel" else 1
    # per chunk: 4 bit fields x BM/16 m-tiles x 2 k-steps of 16, per matrix
    assert loop["HMMA"] == mats * 4 * (c["BM"] // 16) * 2, loop
    # every code looked up by prmt: a thread holds BM/8 rows x 2 words of 16 codes per matrix, two codes a prmt
    assert loop["PRMT"] >= mats * (c["BM"] // 8) * 2 * 8, loop
    assert loop["LDS"] == loop["STS"] == 0, loop  # nothing staged through shared memory
    assert loop["LDL"] == loop["STL"] == 0, loop


def _hls2(E, O, n_in, dtype=torch.float16, groups=1):
    return QWeight(MODE_LUT, 2, n_in, torch.zeros(E, O, n_in // 4, dtype=torch.uint8),
                   torch.zeros(E, O, groups, 4, dtype=dtype))


def test_supports_only_what_the_kernels_read(monkeypatch):
    """2-bit, one fp16 table a row, dims multiples of 128, no h rotation, CUDA tensors."""
    w1, w3, w2 = _hls2(4, 256, 128), _hls2(4, 256, 128), _hls2(4, 128, 256)
    assert not gmd.supports(w1, w3, w2)  # CPU tensors: no Gluon
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert gmd.supports(w1, w3, w2)
    assert not gmd.supports(w1, w3, w2, h_rotate=lambda h: h)
    assert not gmd.supports(_hls2(4, 256, 64), _hls2(4, 256, 64), _hls2(4, 64, 256))  # 64 inputs: half a chunk
    assert not gmd.supports(w1, w3, _hls2(4, 128, 256, torch.float32))  # fp32 tables
    assert not gmd.supports(w1, w3, _hls2(4, 128, 256, groups=2))  # per-group tables


def test_prmt_selector_high_half_is_a_shift():
    """dequant.PRMT_ASM builds the second selector of a field as s0 >> 16 (a full-rate shift) where it once took
    the multiply-high hi(m·0x220000) (a quarter-rate IMAD.HI on Hopper): the same 16 bits for every code quadruple,
    and both selectors are c·0x22 + 0x1010 per code pair (nibbles 2c, 2c + 1)."""
    from itertools import product

    from moec.kernels.dequant import PRMT_ASM

    asm = PRMT_ASM.value
    assert "mul.hi" not in asm and asm.count("shr.b32 s1, s0, 16;") == 4
    assert asm.count("lop3.b32 m, ") == 4 and "0x78f0f4" in asm and "mad.lo.u32 s0, m, 0x22, 0xfa8;" in asm
    for c in product(range(4), repeat=4):
        m = (c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24) | 0x78F0F4
        s0 = (m * 0x22 + 0xFA8) & 0xFFFFFFFF
        assert (s0 >> 16) & 0xFFFF == ((m * 0x220000) >> 32) & 0xFFFF
        assert s0 & 0xFFFF == c[0] * 0x22 + c[1] * 0x2200 + 0x1010
        assert (s0 >> 16) & 0xFFFF == c[2] * 0x22 + c[3] * 0x2200 + 0x1010


def test_tile_codes_puts_each_lanes_words_side_by_side():
    """tile_codes: for 16-row block rb and 128-input chunk ch, lane 4n + c's words q = 0..3 are rows
    rb·16 + n (q < 2) and rb·16 + 8 + n (q >= 2), words ch·8 + 2c + q % 2 of the row-major codes."""
    g = torch.Generator().manual_seed(0)
    E, O, n = 2, 32, 256
    data = torch.randint(0, 256, (E, O, n // 4), dtype=torch.uint8, generator=g)
    t = gmd.tile_codes(data)
    words = data.view(torch.int32).view(E, O, n // 16)
    assert t.shape == (E, O // 16, n // 128, 32, 4)
    lane = torch.arange(32)
    for q in range(4):
        rows = (torch.arange(O // 16)[:, None, None] * 16 + 8 * (q // 2) + (lane // 4)[None, None, :])
        cols = (torch.arange(n // 128)[None, :, None] * 8 + 2 * (lane % 4)[None, None, :] + q % 2)
        rows, cols = torch.broadcast_tensors(rows, cols)
        assert torch.equal(t[..., q], words[:, rows, cols])
