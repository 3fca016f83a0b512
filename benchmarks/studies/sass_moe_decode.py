"""SASS instructions per code in the fused MoE decode loops, compiled for sm_90 on any machine (no GPU).

    python3 -m benchmarks.studies.sass_moe_decode    (2-bit prmt and the previous cubic path, Mixtral shapes)
    python3 -m benchmarks.studies.sass_moe_decode --paths prmt tcq2 tcq3   (the trellis codes, MODE_TCQ)
    python3 -m benchmarks.studies.sass_moe_decode --paths fp4 fp4h   (mxfp4 experts: fp32 words, fp16x2)

Triton compiles the kernels for GPUTarget("cuda", 90, 32); nvdisasm (shipped with Triton) disassembles the
cubin; the count is the instructions between the main loop's label and its backward branch, divided by the
2-bit codes one thread decodes per iteration (gate/up: two matrices).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moec.kernels import moe_decode as md

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def compile_sass(fn, types: dict, consts: dict, num_warps: int) -> str:
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 3})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout


def inner_loop(sass: str) -> list[str]:
    """Instructions of the innermost loop: the shortest label..backward-branch span of 50+ instructions
    (shorter spans are the trap loop after EXIT)."""
    lines = sass.splitlines()
    spans = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        start = next((j for j in range(i, -1, -1) if lines[j].startswith(m.group(1) + ":")), None) if m else None
        if start is not None:
            ins = [x for x in lines[start:i + 1] if re.match(r"\s+/\*[0-9a-f]+\*/", x)]
            if len(ins) >= 50:
                spans.append(ins)
    return min(spans, key=len)


def fp4_loops(fp16x2: bool, BO: int, BK: int, NW: int):
    """gpt-oss-120b's mxfp4 experts (2880 x 2880, top-4, biased clamped SwiGLU): the fp32 word path
    (dequant.gemv_fp4_words) or the fp16x2 one (kernels/fp4_h2.py), 4-bit codes a thread decodes per iteration."""
    common = dict(MODE=5, BITS=4, C=32, BPC=16, G=90, GS=32, BO=BO, BKC=BK // 32, WORDS=True, POLY=False,
                  PRMT=False, FP4H=fp16x2, HAS_BIAS=True, PDL=False)
    t = {"x_ptr": "*i32" if fp16x2 else "*bf16", "ids_ptr": "*i32", "wts_ptr": "*fp32",
         "h_ptr": "*fp16" if fp16x2 else "*fp32", "w1_ptr": "*i32", "w3_ptr": "*i32", "b1_ptr": "*fp32",
         "b3_ptr": "*fp32", "a1_ptr": "*fp16", "a3_ptr": "*fp16", "bg_ptr": "*bf16", "bu_ptr": "*bf16",
         "zero_ptr": "*fp32", "n_zero": "i32"}
    gu = inner_loop(compile_sass(md._gate_up_kernel, t, dict(D=2880, A=4, ACT=2, ZB=0, **common), NW))
    t = {"h_ptr": "*i32" if fp16x2 else "*fp32", "ids_ptr": "*i32", "w2_ptr": "*i32", "a2_ptr": "*fp16",
         "b2_ptr": "*fp32", "out_ptr": "*fp32", "wts_ptr": "*fp32", "bd_ptr": "*bf16"}
    dn = inner_loop(compile_sass(md._down_kernel, t, dict(I=2880, A=4, PER=2880, SPLIT=1, AP=1, **common), NW))
    per_thread = BO * BK // (32 * NW)
    print(f"{'fp4h' if fp16x2 else 'fp4'}: gate/up {len(gu) / (2 * per_thread):.2f}, down {len(dn) / per_thread:.2f} "
          "SASS instructions per code", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="*", default=["prmt", "cubic"],
                    choices=["prmt", "cubic", "tcq2", "tcq3", "tcq4", "fp4", "fp4h"])
    a = ap.parse_args()
    BO, BK, NW = 16, 1024, 8
    for path in a.paths:
        if path.startswith("fp4"):
            fp4_loops(path == "fp4h", BO, BK, NW)
            continue
        prmt, tcq = path == "prmt", path.startswith("tcq")
        C = 16 if prmt else 32
        if tcq:  # MODE_TCQ: int32 words, the row scale fp32 [E, O] in a
            bits = int(path[3:])
            common = dict(A=2, MODE=6, BITS=bits, C=32, BPC=bits, G=1, BO=BO, BKC=BK // 32, WORDS=False,
                          POLY=False, PRMT=False, ASM=True)  # the dp4a byte sum the CUDA launch takes
        else:
            common = dict(A=2, MODE=0, BITS=2, C=C, BPC=4 if prmt else 8, G=1, BO=BO, BKC=BK // C, WORDS=True,
                          POLY=not prmt, PRMT=prmt)
        a_t = "*i32" if prmt else "*fp32" if tcq else "*fp16"
        t = {"x_ptr": "*i32" if prmt else "*fp32", "ids_ptr": "*i32", "wts_ptr": "*fp32",
             "h_ptr": "*fp16" if prmt else "*fp32", "w1_ptr": "*i32", "w3_ptr": "*i32", "b1_ptr": "*fp32",
             "b3_ptr": "*fp32", "a1_ptr": a_t, "a3_ptr": a_t, "bg_ptr": "*fp32", "bu_ptr": "*fp32"}
        gu = inner_loop(compile_sass(md._gate_up_kernel, t, dict(D=4096, GS=4096, **common), NW))
        t = {"h_ptr": "*i32" if prmt else "*fp32", "ids_ptr": "*i32", "w2_ptr": "*i32",
             "a2_ptr": a_t, "b2_ptr": "*fp32", "out_ptr": "*fp32", "wts_ptr": "*fp32", "bd_ptr": "*fp32"}
        dn = inner_loop(compile_sass(md._down_kernel, t, dict(I=14336, PER=7168, SPLIT=2, GS=14336, **common), NW))
        per_thread = BO * BK // (32 * NW)  # codes of one matrix a thread decodes per iteration
        print(f"{'cubic (prmt=False)' if path == 'cubic' else path}: gate/up {len(gu) / (2 * per_thread):.2f}, "
              f"down {len(dn) / per_thread:.2f} SASS instructions per code", flush=True)


if __name__ == "__main__":
    main()
