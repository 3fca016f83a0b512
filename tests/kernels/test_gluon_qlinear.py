"""The Gluon 4-bit decode GEMV (moec/kernels/gluon_qlinear.py) on a machine without a GPU: compiled for sm_90 (Gluon
has no interpreter): it builds for the shipped setting and two others, its layout conversions are free
(assert_trivial), no spills, and the loop does tensor-core MMAs on codes turned into fp16 by a LOP3 and fp16x2
arithmetic, with no shared memory and no quarter-rate multiply-high. Its numbers against qlinear_ref come from the
GPU: benchmarks/gpu_smoke.py (`(kernels)` records) and benchmarks/bench_gluon_qlinear.py."""

from collections import Counter

import pytest
import torch

from moec.kernels import aot, launch_config
from moec.kernels import gluon_qlinear as gq
from moec.kernels.dequant import MODE_AFFINE, QWeight
from moec.kernels.qlinear import qlinear, qlinear_ref

TYPES = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "bias_ptr": "*fp32", "y_ptr": "*bf16",
         "M": "i32", "O": "i32"}
GEMV = launch_config.defaults()["qlinear"]["gemv"]
# (K, BM, KW): pick_warps's three choices at the shipped row count (8 at Mixtral's K, 4 at GLM-4.5-Air's q/k/v, 16
# at its o projection's 12288 inputs), an uneven chunk count (K = 1536: 12 chunks, 8 warps), 32 rows
CASES = [(4096, GEMV["gluon_block_m"], 8), (4096, 16, 4), (12288, 16, 16), (1536, 16, 8), (4096, 32, 4)]


@pytest.fixture(scope="module")
def reports():
    return aot.report_in_subprocess([
        {"module": "moec.kernels.gluon_qlinear", "kernel": "_gemv4_kernel", "types": TYPES,
         "constexprs": {"K": K, "G": K // 128, "BM": bm, "KW": kw, "HAS_BIAS": True},
         "num_warps": kw, "loop_marker": "0x64006400"} for K, bm, kw in CASES])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_compiles_for_sm90(reports, case):
    K, bm, kw = CASES[case]
    res, loop = reports[case]["resources"], Counter(reports[case]["loop"])
    assert res["local"] == 0 and res["registers"] <= 128, res
    assert loop["HMMA"] == 4 * (bm // 16) * 2, loop  # 4 fields x m-tiles x 2 k-steps of 16 per chunk
    # a lane's codes a chunk: bm/8 rows x 4 words x 8; one LOP3 and two fp16x2 ops (sub, fma) per two codes
    assert loop["HFMA2"] >= bm // 8 * 4 * 8 // 2 and loop["HADD2"] >= bm // 8 * 4 * 8 // 2, loop
    assert loop["LDS"] == loop["STS"] == 0 and loop["LDL"] == loop["STL"] == 0, loop


def _rtn4(O, K, G, contiguous=True):
    codes = torch.zeros(1, O, K // 2, dtype=torch.uint8)
    s = torch.ones(1, O, G, dtype=torch.float16)
    return QWeight(MODE_AFFINE, 4, K, codes, s if contiguous else s.transpose(1, 2).contiguous().transpose(1, 2), s)


def test_supports_only_what_it_reads(monkeypatch):
    assert not gq.supports(_rtn4(64, 512, 4), 1)  # CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert gq.supports(_rtn4(64, 512, 4), 1) and gq.supports(_rtn4(64, 512, 2), 8)
    assert not gq.supports(_rtn4(64, 512, 4), 9)  # more tokens than the mma's N
    assert not gq.supports(_rtn4(64, 512, 8), 1)  # groups of 64 inputs: a chunk would straddle two
    assert not gq.supports(_rtn4(64, 512, 4, contiguous=False), 1)
    w = _rtn4(64, 512, 4)
    assert not gq.supports(QWeight(MODE_AFFINE, 3, 512, w.data, w.a, w.b), 1)


def test_qlinear_gluon_flag_falls_back_where_unsupported():
    """gluon=True on a CPU tensor (the interpreter's path) takes the `tl` GEMV: same numbers as the reference."""
    g = torch.Generator().manual_seed(0)
    w = QWeight(MODE_AFFINE, 4, 256, torch.randint(0, 256, (1, 48, 128), dtype=torch.uint8, generator=g),
                (torch.rand(1, 48, 2, generator=g) * 0.01).half(), (torch.rand(1, 48, 2, generator=g) * -0.08).half())
    x = torch.randn(2, 256, generator=g)
    got = qlinear(x, w, gluon=True)
    want = qlinear_ref(x, w)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_gluon_choice_follows_the_switch_and_the_measurement(monkeypatch):
    """backend.gluon_chosen: the measured-faster flag decides under auto, MOEC_KERNELS=gluon forces, tl refuses;
    never on the CPU."""
    from moec.runtime import backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with backend.kernels_forced("auto"):
        assert backend.gluon_chosen("cuda", True) and not backend.gluon_chosen("cuda", False)
        assert not backend.gluon_chosen("cpu", True)
    with backend.kernels_forced("gluon"):
        assert backend.gluon_chosen("cuda", False)
    with backend.kernels_forced("tl"):
        assert not backend.gluon_chosen("cuda", True)


@pytest.mark.parametrize("K,O,want", [(4096, 14336, 4), (12288, 4096, 16), (4096, 6144, 8), (4096, 4096, 8),
                                      (2048, 5120, 8), (4096, 2048, 8), (4096, 2816, 8), (1408, 4096, 8)])
def test_pick_warps_on_the_swept_shapes(K, O, want):
    """The warp count on 132 SMs for the swept projections (GLM-4.5-Air q/k/v and o, Mixtral's, Qwen3's; then GLM's
    shared expert): the sweep's best or within 3% of it (benchmarks/results/gluon_qlinear_h100.json), and the
    shipped config leaves the choice to it."""
    assert gq.pick_warps(K, O, 132) == want
    assert GEMV["gluon_warps"] is None
