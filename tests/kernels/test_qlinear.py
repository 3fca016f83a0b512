"""Quantized linear (attention projections): GEMV and GEMM paths vs the torch reference for 4-bit affine
(rtn) and 16-entry tables (hls), fp8 and bf16, with bias; and the runtime wiring (QLinear attached to a
model's attention, the CPU reference path matching dequantized weights)."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.calibrate import hls  # noqa: E402
from moec.kernels.qlinear import GEMV_MAX_M, qlinear, qlinear_ref  # noqa: E402
from moec.runtime.experts import QLinear, QuantMatrix, attach  # noqa: E402
from tests.kernels.moe_cases import qweight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind,M,K,O,G,unroll", [("rtn4", 1, 64, 40, 2, 1), ("rtn4", 19, 64, 24, 1, 1),
                                                 ("lut4", 3, 32, 20, 2, 1), ("fp8", 2, 48, 24, 1, 1),
                                                 ("bf16", 18, 32, 24, 1, 1), ("rtn4", 2, 128, 24, 4, 2),
                                                 ("lut4", 1, 128, 20, 4, 4), ("int8", 1, 32, 12, 2, 1),
                                                 ("int8", 18, 32, 12, 1, 1)])
def test_qlinear_matches_reference(kind, M, K, O, G, unroll):
    """unroll > 1: several group-sized tiles per loop step of the GEMV."""
    g = torch.Generator().manual_seed(M * K + O)
    w = qweight(kind, 1, O, K, G, g, DEVICE)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    bias = torch.randn(O, generator=g).to(DEVICE)
    cfg = dict(unroll=unroll) if M <= GEMV_MAX_M else dict(block_m=16, block_n=16, block_k=32, num_warps=4)
    got = qlinear(x, w, bias, **cfg)
    want = qlinear_ref(x, w, bias)
    tol = (1e-4 if M <= GEMV_MAX_M else 2e-2) * want.abs().max().item()  # GEMM: bf16 operands on CUDA
    assert got.shape == want.shape and (got.float() - want).abs().max().item() <= tol


@pytest.mark.parametrize("kind,M,K,O,G,unroll,dtype", [("bf16", 1, 64, 24, 1, 1, torch.bfloat16),
                                                       ("rtn4", 2, 128, 24, 4, 2, torch.bfloat16),
                                                       ("lut4", 3, 32, 20, 2, 1, torch.float32),
                                                       ("fp8", 1, 48, 12, 1, 1, torch.bfloat16)])
def test_gated_gemv_equals_silu_mul_then_gemv(kind, M, K, O, G, unroll, dtype):
    """qlinear(gated=True) on a fused gate/up output [g | u] reads silu(g)·u in the GEMV's loads (dequant.load_x) and
    gives exactly what fused_decode.silu_mul then the GEMV give: the same roundings, one launch fewer."""
    from moec.kernels.fused_decode import silu_mul
    from moec.kernels.qlinear import gated_ok

    g = torch.Generator().manual_seed(7 * M + K)
    w = qweight(kind, 1, O, K, G, g, DEVICE)
    gu = (torch.randn(M, 2 * K, generator=g) * 2).to(DEVICE, dtype)
    bias = torch.randn(O, generator=g).to(DEVICE)
    assert gated_ok(w, M) and not gated_ok(w, GEMV_MAX_M + 1)
    got = qlinear(gu, w, bias, gated=True, unroll=unroll)
    want = qlinear(silu_mul(gu), w, bias, unroll=unroll)
    assert got.shape == (M, O) and torch.equal(got, want), (got.float() - want.float()).abs().max()
    ref = qlinear_ref(torch.nn.functional.silu(gu[:, :K].float()) * gu[:, K:].float(), w, bias)
    assert (got.float() - ref).abs().max() <= 2e-2 * ref.abs().max()  # the activation's roundings only


def test_qlinear_module_gated(monkeypatch):
    """QLinear.gated (the fused step's quantized shared down projection, decode.shared_down): with the kernels on, one
    gated GEMV equal to silu_mul then the layer; None where the kernels are off or the Gluon GEMV takes the layer
    (the caller activates first)."""
    from moec.kernels.fused_decode import silu_mul
    from moec.runtime.decode import shared_down

    g = torch.Generator().manual_seed(3)
    W = torch.randn(24, 128, generator=g)
    stored = {k: v[0] for k, v in hls.quantize(W[None], None, "rtn", 4, 32, False).items()}
    lin = QLinear(QuantMatrix("rtn", 4, tuple(W.shape), stored), None)
    gu = torch.randn(1, 256, generator=g).to(DEVICE, torch.bfloat16)
    monkeypatch.setenv("MOEC_KERNELS", "0")
    assert lin.gated(gu) is None and torch.equal(shared_down(lin, gu), lin(silu_mul(gu)))
    monkeypatch.setenv("MOEC_KERNELS", "1")
    got = lin.gated(gu)
    assert got is not None and torch.equal(got, lin(silu_mul(gu))) and torch.equal(shared_down(lin, gu), got)
    # where the Gluon 4-bit GEMV takes the layer (a GPU), silu_mul and it: the gated Gluon load measured slower
    import moec.kernels.gluon_qlinear as gq
    import moec.runtime.experts as ex

    monkeypatch.setattr(ex, "gluon_chosen", lambda device, measured: True)
    monkeypatch.setattr(gq, "supports", lambda w, M: True)
    assert lin.gated(gu) is None


def test_qlinear_module_attached_to_attention():
    """attach() swaps a quantized wq for QLinear; the model runs and matches dequantized weights."""
    from moec.runtime.loader import load_model

    model, _ = load_model("moec/builtin/demo-moe")
    attn = model.layers[0].attn
    W = attn.wq.weight.data.clone()
    stored = hls.quantize(W[None].float(), None, "rtn", 4, 32, False)
    q = QuantMatrix("rtn", 4, tuple(W.shape), {k: v[0] for k, v in stored.items()})
    assert q.shape == (1, *W.shape) and q.kernel_ok()
    W_hat = q.dequant_ref(0)
    tokens = torch.randint(0, model.args.vocab_size, (1, 5))
    attn.wq.weight.data.copy_(W_hat)
    want = model(tokens)
    attach(model, {"layers.0.attn.wq.weight": q}, "cpu")
    assert isinstance(model.layers[0].attn.wq, QLinear)
    got = model(tokens)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_gemm_compile_failure_runs_the_small_config(monkeypatch):
    """A GEMM config Triton cannot compile (3-bit tables with BM >= 64 on sm_90: TritonGPUOptimizeDotOperands
    fails) runs the small GEMM config, a kernel, not the torch path; remembered, so the next call goes there
    directly."""
    from moec.kernels import launch_config
    from moec.kernels import qlinear as ql

    g = torch.Generator().manual_seed(5)
    w = qweight("lut3", 1, 24, 64, 1, g, DEVICE)
    x = torch.randn(70, 64, generator=g).to(DEVICE)  # M > 64: the large GEMM config
    small = launch_config.config("qlinear", x.device)["small_gemm"]
    real, tried = ql._gemm, []

    def gemm(*a):
        tried.append(a[-1])
        if a[-1] != small:
            raise RuntimeError("PassManager::run failed")
        return real(*a)

    monkeypatch.setattr(ql, "_gemm", gemm)
    monkeypatch.setattr(ql, "_BROKEN", set())
    want = qlinear_ref(x, w)
    for _ in range(2):
        got = qlinear(x, w)
        assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    assert tried[1:] == [small, small] and tried[0] != small and len(ql._BROKEN) == 1


def test_3bit_table_gemm_small_config_compiles_for_sm90():
    """The config that 3-bit table GEMMs fall back to compiles for sm_90 (aot.report_in_subprocess)."""
    from moec.kernels import aot
    from moec.kernels.dequant import MODE_LUT, codes_per_chunk
    from moec.kernels.launch_config import config

    c = config("qlinear", "cuda")["small_gemm"]
    C, BPC = codes_per_chunk(MODE_LUT, 3)
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "a_ptr": "*fp32", "b_ptr": "*fp32", "bias_ptr": "*bf16",
             "y_ptr": "*bf16", "M": "i32", "O": "i32", "stride_xm": "i32", "stride_wo": "i32", "stride_ao": "i32"}
    consts = {"K": 768, "HAS_BIAS": False, "MODE": MODE_LUT, "BITS": 3, "C": C, "BPC": BPC, "G": 1, "GS": 768,
              "BM": c["block_m"], "BN": c["block_n"], "BK": c["block_k"], "DOT": {"tl_dtype": "bf16"}, "VD": 1}
    [rep] = aot.report_in_subprocess([{"module": "moec.kernels.qlinear", "kernel": "_gemm_kernel", "types": types,
                                       "constexprs": consts, "num_warps": c["num_warps"]}])
    assert rep["resources"]["stack"] == 0, rep["resources"]


@pytest.mark.parametrize("K,gated", [(96, False), (80, True)])
def test_gemv_early_weights_match_the_chunked_loop(K, gated, monkeypatch):
    """EARLY (plain weights, one row of x, PDL on the GPU; forced here): the program's [BO, K] weight tile loaded ahead
    of the PDL wait and multiplied in one step gives the chunked loop's numbers (fp32 sums in another order), with
    and without the gated activation and a bias; K not a power of two (the tile's padding masked)."""
    import moec.kernels.qlinear as ql

    g = torch.Generator().manual_seed(K)
    w = qweight("bf16", 1, 20, K, 1, g, DEVICE)
    x = torch.randn(1, 2 * K if gated else K, generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(20, generator=g).to(DEVICE)
    loop = qlinear(x, w, bias, gated=gated, block_k=32)
    seen = []
    monkeypatch.setattr(ql, "early_weights", lambda *a: seen.append(a) or True)
    early = qlinear(x, w, bias, gated=gated, block_k=32)
    assert seen and early.shape == loop.shape
    torch.testing.assert_close(early.float(), loop.float(), rtol=1e-2, atol=1e-2)  # one bf16 rounding of each


def test_gemv_early_weights_only_where_they_apply(monkeypatch):
    """early_weights: plain weights of at most EARLY_MAX_K inputs, one row of x, PDL on and the switch on."""
    import moec.kernels.qlinear as ql

    g = torch.Generator().manual_seed(1)
    dense, q4 = qweight("bf16", 1, 8, 64, 1, g, DEVICE), qweight("rtn4", 1, 8, 64, 2, g, DEVICE)
    monkeypatch.setattr(ql.pdl, "enabled", lambda device: True)
    monkeypatch.setenv("MOEC_GEMV_EARLY", "1")
    assert ql.early_weights("cuda", dense, 64, 1)
    assert not ql.early_weights("cuda", q4, 64, 1) and not ql.early_weights("cuda", dense, 64, 2)
    assert not ql.early_weights("cuda", dense, ql.EARLY_MAX_K * 2, 1)
    monkeypatch.setenv("MOEC_GEMV_EARLY", "0")
    assert not ql.early_weights("cuda", dense, 64, 1)
    monkeypatch.setenv("MOEC_GEMV_EARLY", "1")
    monkeypatch.setattr(ql.pdl, "enabled", lambda device: False)
    assert not ql.early_weights("cuda", dense, 64, 1)


@pytest.mark.parametrize("kind,M,E,extra", [("softmax", 1, 40, 24), ("softmax", 3, 64, 0), ("sigmoid", 2, 40, 16)])
def test_gemv_routing_epilogue_equals_the_routing_kernels(kind, M, E, extra):
    """qlinear(route=...): the GEMV whose first E outputs are router logits also routes each row (the last router
    program's epilogue): its outputs equal the plain GEMV's, and its (weights, ids) the routing kernels' on those
    logits (route_topk; route_sigmoid_topk with the correction bias, one group, renormalized and scaled); twice in
    a row (the ticket counter is back to zero after each launch)."""
    from moec.kernels.route_topk import route_sigmoid_topk, route_topk

    g = torch.Generator().manual_seed(E + M)
    w = qweight("bf16", 1, E + extra, 96, 1, g, DEVICE)
    bias = torch.randn(E + extra, generator=g).to(DEVICE)
    sb = torch.randn(E, generator=g).to(DEVICE) * 0.1 if kind == "sigmoid" else None
    route = dict(experts=E, top_k=4, norm=True, kind=kind, score_bias=sb, scale=2.5 if kind == "sigmoid" else 1.0)
    for _ in range(2):
        x = torch.randn(M, 96, generator=g).to(DEVICE, torch.bfloat16)
        y, wts, ids = qlinear(x, w, bias, route=route, block_o=4)
        plain = qlinear(x, w, bias, block_o=4)
        assert torch.equal(y, plain)
        want_w, want_ids = (route_topk(y[:, :E], 4, True) if kind == "softmax" else
                            route_sigmoid_topk(y[:, :E], sb, 4, True, 1, 1, 2.5))
        assert torch.equal(ids, want_ids), (ids, want_ids)
        torch.testing.assert_close(wts, want_w, rtol=1e-6, atol=1e-7)  # the renormalizing sum in another order
