"""The Gluon decode-attention kernel on a machine without a GPU: Gluon has no interpreter, so these tests compile
it for sm_90 (ptxas ships with triton). What that checks: the kernel builds for the configurations the dispatch
launches, every layout conversion it declares free is free (assert_trivial fails the compile otherwise: that is
the codes-in-operand-registers claim), it fits in registers without spilling, and its history loop does the
work it should (tensor-core MMAs, the prmt level lookups) and no shared-memory traffic. Its numbers against the
torch reference come from the GPU: benchmarks/gpu_smoke.py and benchmarks/bench_gluon_kv_attention.py."""

from collections import Counter

import pytest
import torch

from moec.kernels import aot
from moec.kernels import gluon_kv_attention as gka
from moec.kernels import kv_decode_attention as kda
from moec.runtime import backend

TYPES = {n: "*fp32" for n in ("ks_ptr", "klev_ptr", "vlev_ptr", "part_ptr")} | {
    "q_ptr": "*fp16", "kc_ptr": "*i32", "vc_ptr": "*i32", "vs_ptr": "*fp16", "hlen_ptr": "*i32", "wk_ptr": "*fp16",
    "wv_ptr": "*fp16", "wlen_ptr": "*i32", "qscale": "fp32"} | {
    n: "i32" for n in ("H", "K", "S", "WC", "n_splits", "tiles_per_split", "win_splits")}


CONFIG = kda.launch_config.defaults()["kv_decode_attention"]["gluon"]


LOOP = "0x3030303"  # the history loop: the innermost loop holding the code mask
CASES = [4, 8]  # query heads per KV head: Mixtral's, Qwen3's


@pytest.fixture(scope="module")
def reports():
    """Every compile of this file in one fresh process (aot.report_in_subprocess says why)."""
    jobs = [{"module": "moec.kernels.gluon_kv_attention", "kernel": "_gluon_kv_attention_kernel", "types": TYPES,
             "constexprs": {"D": 128, "G": G, "T": CONFIG["block_t"], "WCHUNK": CONFIG["win_chunk"],
                            "PREFETCH": CONFIG["prefetch"]},
             "num_warps": 1, "maxnreg": CONFIG["maxnreg"] if G <= 8 else None, "loop_marker": LOOP}
            for G in CASES]
    jobs.append({"module": "moec.kernels.gluon_kv_attention_wg", "kernel": "_gluon_kv_attention_wg_kernel",
                 "types": TYPES | {"kcen_ptr": "*fp32", "kerr_ptr": "*fp32"},
                 "constexprs": {"D": 128, "G": 4, "T": CONFIG["block_t"], "CENTER": True, "BIAS": True,
                                "WCHUNK": 128, "PREFETCH": CONFIG["prefetch"]},
                 "num_warps": 4, "maxnreg": CONFIG["maxnreg_wg"], "loop_marker": LOOP})
    return aot.report_in_subprocess(jobs)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_compiles_for_sm90_without_spills_or_shared_staging(reports, case):
    res, loop = reports[case]["resources"], Counter(reports[case]["loop"])
    assert res["registers"] <= CONFIG["maxnreg"], res  # >= 15 one-warp programs per SM
    T, N = CONFIG["block_t"], 8  # tokens per tile; the query heads' mma dimension
    # QK and PV on tensor cores: 4 channel blocks x 2 products x T/16 token tiles x N/8 x 2 K steps
    assert loop["HMMA"] == 2 * 4 * (T // 16) * (N // 8) * 2, loop
    # every code is looked up by prmt: two per word and bit field, K and V (T tokens x 8 words each)
    assert loop["PRMT"] >= 2 * 4 * 2 * T * 8 // 32, loop
    assert loop["LDS"] == loop["STS"] == 0, loop  # nothing staged through shared memory
    assert loop["LDL"] == loop["STL"] == 0, loop  # no spills in the loop
    assert loop["LDG"] <= 3 * T // 8 + 8, loop  # wide loads: words, not bytes


def test_warp_group_kernel_compiles_without_spills_or_shared_staging_in_its_loop(reports):
    """The W-warp variant (gluon_kv_attention_wg.py, not the default until a GPU has timed it): the same loop per
    warp; shared memory only for the warps' final combine."""
    res, loop = reports[-1]["resources"], Counter(reports[-1]["loop"])
    assert res["registers"] <= CONFIG["maxnreg_wg"] and res["local"] == 0, res
    assert loop["HMMA"] == 2 * 4 * (CONFIG["block_t"] // 16) * 2, loop
    assert loop["LDS"] == loop["STS"] == loop["LDL"] == loop["STL"] == 0, loop


def test_dispatch_switch(monkeypatch):
    """MOEC_KERNELS=tl keeps the `tl` kernel; the Gluon kernel only serves what it supports, only on CUDA."""
    assert gka.supports(2, 0, None, 128, 4) and gka.supports(2, 0, None, 128, 16)
    assert not gka.supports(3, 0, None, 128, 4)  # 3-bit codes
    assert not gka.supports(2, 8, None, 128, 4)  # sparse outliers
    assert not gka.supports(2, 0, (torch.ones(64), 0), 128, 4)  # pre-RoPE keys
    assert not gka.supports(2, 0, None, 64, 4) and not gka.supports(2, 0, None, 128, 32)
    with backend.kernels_forced("tl"):
        assert backend.kernels_enabled("cuda") and not backend.gluon_enabled("cuda")
    with backend.kernels_forced("gluon"):
        assert backend.kernels_enabled("cuda") and backend.gluon_forced() and not backend.kernels_enabled("cpu")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert backend.gluon_enabled("cuda")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not backend.gluon_enabled("cuda")  # Gluon has no interpreter
    with backend.kernels_forced("auto"):
        assert not backend.gluon_enabled("cpu")
    with backend.kernels_forced("0"):
        assert not backend.gluon_enabled("cuda")



def test_default_splits_follow_the_measured_optima():
    """Splits per (sequence, KV head) on the H200 (132 SMs): about one per SM at batch 1, 32 at batch 16 (the
    optima of gluon_kv_attention_sweep2_h200.json), no split under 128 tokens."""
    T = CONFIG["block_t"]
    assert gka.default_splits(1, 32768, T, CONFIG, 132) == 132
    assert gka.default_splits(16, 32768, T, CONFIG, 132) == 32
    assert gka.default_splits(1, 4096, T, CONFIG, 132) == 32
    assert gka.default_splits(1, 100, T, CONFIG, 132) == 1


def test_runtime_dispatch_passes_the_cache_through(monkeypatch):
    """kvtiered.decode_attention sends a cache the Gluon kernel serves (and is faster on) to it with the very
    tensors and options the `tl` kernel would get, and everything else to the `tl` kernel. The launches are
    stubbed: this checks the wiring on a CPU, the GPU smoke checks the numbers."""
    from moec.runtime import kvtiered

    calls = []
    monkeypatch.setattr(kvtiered, "gluon_enabled", lambda device: True)
    monkeypatch.setattr(gka, "gluon_kv_attention", lambda *a, **k: calls.append(("gluon", a, k)) or a[0].float())
    monkeypatch.setattr(kda, "kv_decode_attention", lambda *a, **k: calls.append(("tl", a, k)) or a[0].float())

    def cache(B, S, nout=0, G=4):
        K = 2
        z = torch.zeros(B, K, S // 32, nout)
        return dict(q=torch.randn(B, K * G, 128), k_codes=torch.zeros(B, K, S, 32, dtype=torch.uint8),
                    v_codes=torch.zeros(B, K, S, 32, dtype=torch.uint8), k_scale=torch.ones(K, 128),
                    v_scale=torch.ones(B, K, S).half(), k_lev=torch.zeros(4), v_lev=torch.zeros(4),
                    k_oidx=z.short(), k_oval=z.half(), v_oidx=z.short(), v_oval=z.half(),
                    hist_len=torch.zeros(B, dtype=torch.int32), win_k=torch.zeros(B, K, 8, 128).half(),
                    win_v=torch.zeros(B, K, 8, 128).half(), win_len=torch.zeros(B, dtype=torch.int32))

    extra = dict(k_center=torch.ones(2, 128), k_err2=torch.ones(2, 128), out_rotation=torch.eye(128),
                 out_dtype=torch.bfloat16)
    c = cache(1, 32768)
    kvtiered.decode_attention(*c.values(), bits=2, block=32, **extra)
    kind, args, kw = calls[-1]
    assert kind == "gluon" and all(a is b for a, b in zip(args, [c[n] for n in (
        "q", "k_codes", "v_codes", "k_scale", "v_scale", "k_lev", "v_lev", "hist_len", "win_k", "win_v", "win_len")],
        strict=True))
    assert all(kw[n] is extra[n] for n in extra)
    # a short history at batch 1, sparse outliers, 3-bit codes, more than 16 query heads per KV head
    for c, bits in ((cache(1, 4096), 2), (cache(1, 32768, nout=8), 2), (cache(1, 32768), 3),
                    (cache(2, 32768, G=32), 2)):
        kvtiered.decode_attention(*c.values(), bits=bits, block=32, **extra)
        assert calls[-1][0] == "tl"
    with backend.kernels_forced("gluon"):  # the smoke's check of the Gluon path: also where tl is faster
        kvtiered.decode_attention(*cache(1, 4096).values(), bits=2, block=32, **extra)
        assert calls[-1][0] == "gluon"
        kvtiered.decode_attention(*cache(1, 4096, nout=8).values(), bits=2, block=32, **extra)
        assert calls[-1][0] == "tl"  # but never a cache it does not support
