"""The trellis fit's Viterbi kernel (kernels/tcq_viterbi.py) against the torch search it replaces on CUDA
(calibrate/tcq.viterbi): the same states, bit for bit, at 2 and 3 bits, with and without a start state and
column weights, for the block lengths a fit uses; and its sm_90 compile (Triton's passes and ptxas, no launch:
the interpreter never compiles). CPU: Triton's interpreter; CUDA: the device."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernel in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.calibrate.tcq import viterbi  # noqa: E402
from moec.kernels import aot  # noqa: E402
from moec.kernels.tcq_viterbi import viterbi_rows  # noqa: E402
from moec.runtime.tcq import code_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("k,T,start,weighted", [(2, 40, True, True), (2, 40, False, False), (3, 24, True, True),
                                                 (3, 8, False, True), (2, 1, True, False)])
def test_kernel_states_equal_the_torch_search(k, T, start, weighted, monkeypatch):
    g = torch.Generator().manual_seed(k * 100 + T)
    N = 5
    x = (torch.randn(N, T, generator=g) * 1.2).to(DEVICE)
    w = (torch.rand(T, generator=g) + 0.3).to(DEVICE) if weighted else None
    st = torch.randint(0, 4096, (N,), generator=g).to(DEVICE) if start else None
    table = code_table(12).to(DEVICE)
    monkeypatch.setenv("MOEC_TCQ_VITERBI", "torch")  # the torch search also on CUDA
    want = viterbi(x, 12, k, st, table, w)
    monkeypatch.delenv("MOEC_TCQ_VITERBI")
    got = viterbi_rows(x, table, k, w, st)
    assert torch.equal(got, want)
    if st is not None:  # the path continues the start state: s_0's low L - k bits are its top ones
        assert torch.equal(got[:, 0] & ((1 << (12 - k)) - 1), st >> k)


def test_no_rows():
    assert viterbi_rows(torch.zeros(0, 8, device=DEVICE), code_table(12).to(DEVICE), 2).shape == (0, 8)


def test_compiles_for_sm90_without_spills_or_fused_multiply_adds():
    """sm_90 at the fit's block length, 2-4 bits, with and without a start state (aot.report_in_subprocess: the
    interpreter never compiles): no spills, and no FFMA, since the torch search rounds (x - c)² · w before adding."""
    ptrs = {"x_ptr": "*fp32", "w_ptr": "*fp32", "table_ptr": "*fp32", "start_ptr": "*i64", "bp_ptr": "*u8",
            "out_ptr": "*i64"}
    jobs = [{"module": "moec.kernels.tcq_viterbi", "kernel": "_viterbi_kernel", "types": ptrs, "num_warps": 8,
             "constexprs": {"T": 40, "S": 4096, "K": 1 << k, "KBITS": k, "HAS_START": has_start},
             "enable_fp_fusion": False} for k in (2, 3, 4) for has_start in (False, True)]
    for job, rep in zip(jobs, aot.report_in_subprocess(jobs), strict=True):
        assert rep["resources"]["stack"] == 0, (job["constexprs"], rep["resources"])
        assert rep["opcodes"].get("FFMA", 0) == 0 and rep["opcodes"].get("FMNMX", 0) > 0, rep["opcodes"]
