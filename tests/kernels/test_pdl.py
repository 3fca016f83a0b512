"""Programmatic dependent launch (moec/kernels/pdl.py) without a GPU: which devices take it, that every wired kernel
waits for its predecessor before anything else (in the source, and in the PTX of kernels compiled for sm_90), and
that every launch passing pdl.options goes to a kernel that has the switch. Whether it is faster, and the logits
with it, come from the GPU (benchmarks/gpu_smoke.py runs the default, i.e. PDL on Hopper)."""

import ast
from pathlib import Path

import pytest
import torch

from moec.kernels import aot, pdl

KERNELS = Path(__file__).resolve().parents[2] / "moec" / "kernels"
BEGIN = {"pdl_begin", "gluon_begin"}


def _jit_functions(tree) -> dict[str, ast.FunctionDef]:
    """Module-level functions decorated @triton.jit or @gluon.jit."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Attribute) and d.attr == "jit" for d in node.decorator_list):
            out[node.name] = node
    return out


def _wired(fn: ast.FunctionDef) -> bool:
    return any(a.arg == "PDL" for a in fn.args.args)


# what may come ahead of the wait: the weight rows of qlinear's dense GEMV (EARLY), which no step kernel writes
BEFORE_WAIT = {"_weights_before_wait"}


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    """The first statement that is not the docstring or an assignment from a BEFORE_WAIT load."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                str):
        body = body[1:]  # the docstring
    while isinstance(body[0], ast.Assign) and isinstance(body[0].value, ast.Call) and \
            getattr(body[0].value.func, "id", None) in BEFORE_WAIT:
        body = body[1:]
    return body[0]


def _pdl_launches(tree) -> list[str]:
    """Names of the kernels launched as NAME[grid](..., **pdl.options(...))."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value,
                                                                                               ast.Name):
            for kw in node.keywords:
                v = kw.value
                if kw.arg is None and isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and \
                        v.func.attr == "options" and isinstance(v.func.value, ast.Name) and v.func.value.id == "pdl":
                    names.append(node.func.value.id)
    return names


def test_wired_kernels_wait_first_and_every_pdl_launch_reaches_one():
    wired, launched = {}, []
    for p in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(p.read_text())
        for name, fn in _jit_functions(tree).items():
            if _wired(fn) and p.name != "pdl.py":  # pdl.py: the begin helpers themselves
                first = _first_statement(fn)
                call = first.value if isinstance(first, ast.Expr) else None
                assert isinstance(call, ast.Call) and getattr(call.func, "id", None) in BEGIN and \
                    [getattr(a, "id", None) for a in call.args] == ["PDL"], f"{p.name}:{name}: not the wait first"
                wired[name] = p.name
        launched += [(p.name, n) for n in _pdl_launches(tree)]
    # the decode step's kernels (what the GPU step launches at batch 1) are all wired
    assert {"_add_rms_norm_kernel", "_qk_norm_rope_kernel", "_mla_rope_latent_kernel", "_silu_mul_kernel",
            "_prmt_pairs_kernel", "_gate_up_kernel", "_down_kernel", "_gemv_kernel", "_gemv4_kernel",
            "_kv_decode_attention_kernel", "_gluon_kv_attention_kernel", "_gluon_kv_attention_wg_kernel",
            "_reduce_kernel", "_fp16_decode_kernel", "_mla_decode_kernel", "_mla_nuq_kernel", "_route_topk_kernel",
            "_route_gemv_topk_kernel", "_route_sigmoid_kernel", "_rotate_write_kernel",
            "_mla_uv_kernel"} <= set(wired), wired
    unwired = [(f, n) for f, n in launched if n not in wired]
    assert launched and not unwired, unwired


def test_enabled_only_on_hopper_cuda_outside_the_interpreter(monkeypatch):
    assert not pdl.enabled("cpu") and pdl.options(torch.device("cpu")) == {}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 0)  # device 0 Hopper, device 1 older
    assert pdl.enabled("cuda:0") and pdl.options("cuda:0") == {"PDL": True, "launch_pdl": True}
    assert not pdl.enabled("cuda:1")
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled("cuda:0") and pdl.options("cuda:0") == {}
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled("cuda:0")


DOWN = {"h_ptr": "*i32", "ids_ptr": "*i32", "w2_ptr": "*i32", "a2_ptr": "*i32", "b2_ptr": "*fp32", "out_ptr": "*fp32",
        "wts_ptr": "*fp32", "bd_ptr": "*fp32", "D": "i32", "stride_we": "i32", "stride_wo": "i32",
        "stride_ae": "i32", "stride_ao": "i32"}
JOBS = [
    {"module": "moec.kernels.fused_decode", "kernel": "_add_rms_norm_kernel",
     "types": {n: "*bf16" for n in ("x_ptr", "d_ptr", "d2_ptr", "w_ptr", "xo_ptr", "h_ptr")}
     | {n: "i32" for n in ("D", "sx", "sd", "sd2", "sxo", "sh")} | {"eps": "fp32"},
     "constexprs": {"HAS_DELTA": True, "HAS_DELTA2": False, "BLOCK": 2048, "PDL": True},
     "num_warps": 4},
    # the down GEMV with its fp32 atomics (split inputs), prmt lookups: GLM-4.5-Air's expert width
    {"module": "moec.kernels.moe_decode", "kernel": "_down_kernel", "types": DOWN,
     "constexprs": dict(I=1408, A=8, PER=1024, SPLIT=2, MODE=0, BITS=2, C=16, BPC=4, G=1, GS=1408, BO=16, BKC=64,
                        WORDS=True, POLY=False, PRMT=True, PDL=True), "num_warps": 8},
    # the one-warp Gluon KV attention (its prologue loads q and the history's first tile)
    {"module": "moec.kernels.gluon_kv_attention", "kernel": "_gluon_kv_attention_kernel",
     "types": {n: "*fp32" for n in ("ks_ptr", "klev_ptr", "vlev_ptr", "part_ptr")} | {
         "q_ptr": "*fp16", "kc_ptr": "*i32", "vc_ptr": "*i32", "vs_ptr": "*fp16", "hlen_ptr": "*i32",
         "wk_ptr": "*fp16", "wv_ptr": "*fp16", "wlen_ptr": "*i32", "qscale": "fp32"} | {
         n: "i32" for n in ("H", "K", "S", "WC", "n_splits", "tiles_per_split", "win_splits")},
     "constexprs": {"D": 128, "G": 4, "T": 32, "WCHUNK": 128, "PREFETCH": True, "PDL": True}, "num_warps": 1},
    # the dense GEMV with its weights loaded ahead of the wait (EARLY: DeepSeek-V2-Lite's shared down, gated)
    {"module": "moec.kernels.qlinear", "kernel": "_gemv_kernel",
     "types": {n: "*bf16" for n in ("x_ptr", "w_ptr", "a_ptr", "b_ptr", "bias_ptr", "y_ptr")}
     | {n: "i32" for n in ("O", "stride_xm", "stride_wo", "stride_ao")}
     | {"rscale": "fp32", "count_ptr": "*i32", "rw_ptr": "*fp32", "rids_ptr": "*i32", "rb_ptr": "*fp32"},
     "constexprs": dict(K=2816, HAS_BIAS=False, MODE=3, BITS=16, C=1, BPC=1, G=1, GS=2816, BO=4, BKC=1024, UNROLL=2,
                        PDL=True, EARLY=True, KP=4096, GATED=True), "num_warps": 8},
    {"module": "moec.kernels.gluon_qlinear", "kernel": "_gemv4_kernel",
     "types": {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "bias_ptr": "*fp32",
               "y_ptr": "*bf16", "M": "i32", "O": "i32"},
     "constexprs": {"K": 4096, "G": 32, "BM": 16, "KW": 8, "HAS_BIAS": True, "PDL": True}, "num_warps": 8},
]


@pytest.fixture(scope="module")
def reports():
    return aot.report_in_subprocess(JOBS)


@pytest.mark.parametrize("case", range(len(JOBS)), ids=[j["kernel"] for j in JOBS])
def test_sm90_build_waits_before_its_first_global_access(reports, case):
    order = reports[case]["ptx_order"]
    assert None not in order.values(), order
    assert reports[case]["opcodes"].get("ACQBULK", 0) >= 1, "no griddepcontrol.wait in the SASS"
    assert order["wait"] < order["launch_dependents"] < order["store"], order
    if JOBS[case]["constexprs"].get("EARLY"):  # weight loads ahead of the wait, nothing written before it
        assert order["global"] < order["wait"], order
    else:
        assert order["launch_dependents"] < order["global"], order
