"""Vector-codebook weights (codec vq, kernels/dequant.py MODE_VQ) in the fused kernels vs their torch
references: QWeight/dequant_ref against the codec's own dequantize_vq, the MoE decode GEMV (word-chunk and
byte-code variants), the grouped prefill kernel, the quantized linear (GEMV and GEMM), and the runtime
wiring (QuantMatrix -> ExpertWeights.fused / QLinear). Code widths bits·d: 8 (2, 4), 6 (3, 2), 4 (2, 2),
12 (3, 4), plus d = 1. CPU: Triton's interpreter at toy shapes; CUDA: the same cases on the device.
`python3 -m tests.kernels.test_vq_kernels` compiles the vq kernels for sm_90 at Mixtral shapes on any
machine (Triton's passes and ptxas; the interpreter never compiles)."""

import os

import torch

if not torch.cuda.is_available() and __name__ != "__main__":  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.dequant import MODE_VQ, QWeight, dequant_ref, vq_static  # noqa: E402
from moec.kernels.moe_decode import moe_decode, moe_decode_ref  # noqa: E402
from moec.kernels.moe_prefill import moe_grouped, moe_grouped_ref  # noqa: E402
from moec.kernels.qlinear import GEMV_MAX_M, qlinear, qlinear_ref  # noqa: E402
from moec.runtime.backend import kernels_forced  # noqa: E402
from moec.runtime.experts import ExpertWeights, QLinear, QuantMatrix  # noqa: E402
from moec.runtime.weightcodecs import dequantize_vq, random_vq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BITS_DIMS = [(2, 4), (3, 2), (2, 2), (3, 4)]  # code widths 8, 6, 4, 12


def vq_weight(bits: int, d: int, E: int, O: int, n_in: int, gen: torch.Generator) -> QWeight:
    st = random_vq(bits, (E, O, n_in), d, "cpu", gen)
    st["row_scale"] = (torch.rand(E, O, generator=gen) * 0.04 + 0.01).half()  # rows of different scales
    return QWeight(MODE_VQ, bits, n_in, st["codes"].to(DEVICE), st["codebook"].to(DEVICE), st["row_scale"].to(DEVICE))


def vq_case(bits, d, N, A, E, D, I, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (vq_weight(bits, d, E, o, i, gen) for o, i in ((I, D), (I, D), (D, I)))
    x = torch.randn(N, D, generator=gen).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(N)]).to(DEVICE)
    wts = torch.softmax(torch.randn(N, A, generator=gen), -1).to(DEVICE)
    return x, ids, wts, w1, w3, w2


def rel_err(got, want) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("bits,d", BITS_DIMS + [(3, 1), (4, 2)])
def test_dequant_ref_is_the_codec_reference(bits, d):
    gen = torch.Generator().manual_seed(bits * 10 + d)
    E, O, n = 2, 5, 64
    st = random_vq(bits, (E, O, n), d, "cpu", gen)
    w = QWeight(MODE_VQ, bits, n, st["codes"], st["codebook"], st["row_scale"])
    w.check(E, O)
    assert w.groups == 1 and w.vq_dim == d and w.row_stride_a() == 0
    assert torch.equal(dequant_ref(w), dequantize_vq(bits, (E, O, n), st))
    assert w.vq_words()  # rows of whole word chunks: their views are the same bytes
    codes, cb = w.vq_views()
    assert codes.dtype == torch.int32 and codes.untyped_storage().data_ptr() == st["codes"].untyped_storage().data_ptr()
    assert cb.view(torch.float16).reshape(st["codebook"].shape).equal(st["codebook"])


def test_word_chunks_need_whole_chunks():
    gen = torch.Generator().manual_seed(0)
    assert vq_static(vq_weight(3, 2, 1, 4, 64, gen), 1024)["VQF"]  # 32 codes: two 16-code chunks
    assert not vq_static(vq_weight(3, 2, 1, 4, 40, gen), 1024)["VQF"]  # 20 codes: byte codes
    assert not vq_static(vq_weight(2, 4, 1, 4, 64, gen), 1024, words=False)["VQF"]
    assert vq_static(vq_weight(2, 4, 1, 4, 64, gen), 1024, gather=True)["VQF"] == 2
    assert vq_static(vq_weight(3, 4, 1, 4, 64, gen), 1024, gather=True)["VQF"] == 1  # K = 4096: L1 gathers


# (N tokens, top-k A, experts E, D, I): D = 48, I = 40 are rows of partial word chunks for some widths (the
# default then takes byte codes) and not multiples of the tiles
# (the gather and byte variants on one shape each: the interpreter's time goes to the CI budget)
@pytest.mark.parametrize("bits,d", BITS_DIMS)
@pytest.mark.parametrize("N,A,E,D,I,path", [(1, 2, 4, 64, 32, "words"), (2, 2, 3, 32, 64, "words"),
                                             (1, 1, 3, 48, 40, "words"), (1, 2, 4, 64, 32, "gather"),
                                             (2, 2, 3, 32, 64, "bytes")])
def test_moe_decode_matches_reference(bits, d, N, A, E, D, I, path):
    """The three GEMV variants: word chunks (the default), byte codes (words=False), tl.gather lookups."""
    x, ids, wts, w1, w3, w2 = vq_case(bits, d, N, A, E, D, I, seed=bits + d + N + D)
    got = moe_decode(x, ids, wts, w1, w3, w2, block_o=32, block_k=64, block_o_down=64, block_k_down=32,
                     words=path != "bytes", vq_gather=path == "gather")
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-4, (bits, d, path)  # fp32 sums in another order


@pytest.mark.parametrize("bits,d", [(2, 4), (3, 2)])
def test_moe_decode_bf16_x_and_split(bits, d):
    """bf16 activations are read in place (the same output as their fp32 copy), and the split-I down
    launch (fp32 atomics) agrees with one program per row block."""
    x, ids, wts, w1, w3, w2 = vq_case(bits, d, 2, 2, 4, 32, 64, seed=7)
    xb = x.to(torch.bfloat16)
    kw = dict(block_o=32, block_k=32, block_o_down=32, block_k_down=32)
    a = moe_decode(xb, ids, wts, w1, w3, w2, split=1, **kw)
    b = moe_decode(xb.float(), ids, wts, w1, w3, w2, split=2, **kw)
    want = moe_decode_ref(xb, ids, wts, w1, w3, w2)
    assert rel_err(a, want) <= 1e-4 and rel_err(b, want) <= 1e-4


@pytest.mark.parametrize("bits,d", BITS_DIMS)
def test_grouped_matches_reference(bits, d):
    x, ids, wts, w1, w3, w2 = vq_case(bits, d, 5, 2, 4, 32, 64, seed=bits * d)
    got = moe_grouped(x, ids, wts, w1, w3, w2, block_m=16, block_n=32, block_k=32, num_warps=4)
    want = moe_grouped_ref(x, ids, wts, w1, w3, w2)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert rel_err(got, want) <= 2e-2  # h stored bf16 (and bf16 dot operands on CUDA)


@pytest.mark.parametrize("bits,d", BITS_DIMS)
@pytest.mark.parametrize("M", [1, 19])
def test_qlinear_matches_reference(bits, d, M):
    gen = torch.Generator().manual_seed(M + bits * d)
    K, O = 64, 24
    w = vq_weight(bits, d, 1, O, K, gen)
    x = torch.randn(M, K, generator=gen).to(DEVICE)
    bias = torch.randn(O, generator=gen).to(DEVICE)
    cfg = dict(unroll=2, block_k=32) if M <= GEMV_MAX_M else dict(block_m=16, block_n=16, block_k=32, num_warps=4)
    got = qlinear(x, w, bias, **cfg)
    want = qlinear_ref(x, w, bias)
    tol = 1e-4 if M <= GEMV_MAX_M else 2e-2
    assert got.shape == want.shape and rel_err(got, want) <= tol
    if M == 1:  # the byte-code and tl.gather GEMV variants
        assert rel_err(qlinear(x, w, bias, words=False), want) <= tol
        assert rel_err(qlinear(x, w, bias, vq_gather=True), want) <= tol


@pytest.mark.parametrize("N,shared", [(1, False), (3, False), (1, True), (3, True)])  # decode GEMV, grouped
def test_runtime_fused_path(N, shared):
    """QuantMatrix("vq") hands the stored parts to the kernels (kernel_mode 4) and ExpertWeights.fused
    (MOEC_KERNELS=1: the interpreter on the CPU) matches the torch reference path. shared: one codebook
    stored for every expert ([1, K, d], a rule's shared_codebook), held per expert."""
    gen = torch.Generator().manual_seed(N)
    E, D, I, bits, d = 4, 64, 32, 2, 4
    stored = [random_vq(bits, (E, o, i), d, "cpu", gen) for o, i in ((I, D), (I, D), (D, I))]
    if shared:
        stored = [st | {"codebook": st["codebook"][1:2]} for st in stored]
    qs = [QuantMatrix("vq", bits, (E, o, i), st) for (o, i), st in zip(((I, D), (I, D), (D, I)), stored, strict=True)]
    assert all(q.kernel_mode == MODE_VQ and q.kernel_ok() for q in qs)
    for q, st in zip(qs, stored, strict=True):  # every expert reads the one stored codebook
        assert q.codebook.shape[0] == E and torch.equal(q.codebook, st["codebook"].expand(E, -1, -1))
        assert torch.equal(q.dequant_ref(), dequantize_vq(bits, q.shape, st))
    ew = ExpertWeights(*qs).to(DEVICE)
    x = torch.randn(N, D, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(N)]).to(DEVICE)
    wts = torch.full((N, 2), 0.5, device=DEVICE)
    with kernels_forced("1"):
        out = ew.fused(x, wts, ids)
    assert out is not None
    want = torch.zeros_like(x)
    for n in range(N):
        for a in range(2):
            want[n] += 0.5 * ew.expert(int(ids[n, a]), x[n:n + 1])[0]
    assert rel_err(out, want) <= (1e-4 if N == 1 else 2e-2)


def test_runtime_qlinear():
    gen = torch.Generator().manual_seed(5)
    O, K = 24, 64
    st = random_vq(3, (1, O, K), 2, "cpu", gen)
    q = QuantMatrix("vq", 3, (O, K), {"codes": st["codes"][0], "codebook": st["codebook"][0],
                                       "row_scale": st["row_scale"][0]})
    assert q.kernel_ok()
    lin = QLinear(q, None).to(DEVICE)
    x = torch.randn(2, K, generator=gen).to(DEVICE)
    want = x @ dequantize_vq(3, (1, O, K), st)[0].to(DEVICE).t()
    with kernels_forced("1"):
        got = lin(x)
    assert rel_err(got, want) <= 1e-4


def compile_sm90_all() -> list[str]:
    """Compile every vq launch (decode gate/up and down in its three GEMV variants, the grouped kernels at
    the small and the prefill config, the qlinear GEMV and GEMM) for sm_90; returns what compiled."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moec.kernels import moe_decode as md
    from moec.kernels import moe_prefill as mp
    from moec.kernels import qlinear as ql
    from moec.kernels.dequant import vq_chunk

    def compile_(fn, ptrs, consts, warps):
        sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "i32") for n in fn.arg_names}
        const = {(fn.arg_names.index(n),): v for n, v in consts.items()}
        return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

    done = []
    for bits, d in BITS_DIMS:
        cpc, nw = vq_chunk(bits * d)
        for vqf in (0, 1, 2) if bits * d <= 8 else (0, 1):
            C, BPC = (cpc * d, nw) if vqf else (d, 1)
            cb = "*fp16" if vqf == 0 else "*i32" if d == 2 else "*i64"
            st = dict(MODE=MODE_VQ, BITS=bits, C=C, BPC=BPC, G=1, GS=4096, BKC=1024 // C, WORDS=False, POLY=False,
                      PRMT=False, VD=d, VQF=vqf)
            p = {"x_ptr": "*bf16", "ids_ptr": "*i32", "wts_ptr": "*fp32", "h_ptr": "*fp32", "out_ptr": "*fp32"}
            p |= {f"{k}{i}_ptr": t for i in (1, 2, 3) for k, t in (("w", "*i32" if vqf else "*u8"), ("a", cb),
                                                                   ("b", "*fp16"))}
            compile_(md._gate_up_kernel, p, st | dict(D=4096, A=2, BO=16), 8)
            compile_(md._down_kernel, p, st | dict(I=14336, A=2, PER=14336, SPLIT=1, BO=16), 8)
            qp = {"x_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "b_ptr": "*fp16", "w_ptr": p["w1_ptr"],
                  "a_ptr": cb}
            compile_(ql._gemv_kernel, qp, dict(K=4096, HAS_BIAS=False, MODE=MODE_VQ, BITS=bits, C=C, BPC=BPC, G=1,
                                               GS=4096, BO=4, BKC=1024 // C, UNROLL=4, VD=d, VQF=vqf), 8)
            done.append(f"decode+gemv vq bits {bits} d {d} VQF {vqf}")
        pp = {"x_ptr": "*bf16", "sid_ptr": "*i32", "bexp_ptr": "*i32", "h_ptr": "*bf16", "wts_ptr": "*fp32",
              "y_ptr": "*bf16", "w_ptr": "*u8", "a_ptr": "*fp16", "b_ptr": "*fp16", "bias_ptr": "*bf16"}
        pp |= {f"{k}{i}_ptr": t for i in (1, 2, 3) for k, t in (("w", "*u8"), ("a", "*fp16"), ("b", "*fp16"))}
        for cfg in (mp.SMALL_CONFIG, mp.PREFILL_CONFIG):
            st = dict(MODE=MODE_VQ, BITS=bits, C=d, BPC=1, G=1, GS=4096, VD=d, BM=cfg["block_m"], BN=cfg["block_n"],
                      BK=cfg["block_k"], DOT=tl.bfloat16)
            compile_(mp._gate_up_kernel, pp, st | dict(D=4096, A=2), cfg["num_warps"])
            compile_(mp._down_kernel, pp, st | dict(I=14336), cfg["num_warps"])
        compile_(ql._gemm_kernel, pp, dict(K=4096, HAS_BIAS=False, MODE=MODE_VQ, BITS=bits, C=d, BPC=1, G=1, GS=4096,
                                           BM=128, BN=128, BK=64, DOT=tl.bfloat16, VD=d), 8)
        done.append(f"grouped+gemm vq bits {bits} d {d}")
    return done


if __name__ == "__main__":
    for line in compile_sm90_all():
        print(line, "compiled")
