"""Compile a kernel for a CUDA target without a GPU, and read its SASS (ptxas and cuobjdump ship with triton).

report_in_subprocess compiles in a fresh interpreter: after triton's CPU interpreter has run a kernel in a
process (TRITON_INTERPRET=1, as the test suite runs), compiling a Gluon kernel in that process fails inside
triton's code generator (an ir.block_argument without a dtype), so the suite's compile checks run apart.

Gluon has no CPU interpreter, so CI cannot run the Gluon kernels; it compiles them for sm_90 instead, which
checks what can be checked without a GPU: that the kernel builds, that every layout conversion declared free
(`convert_layout(..., assert_trivial=True)`) is free, and its registers and spills. The studies use the same
compile to count SASS instructions per packed code (benchmarks/studies/gluon_sass.py).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def with_defaults(fn, constexprs: dict) -> dict:
    """constexprs plus the defaults of fn's constexpr parameters not given (e.g. a kernel's PDL switch)."""
    return {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs


def signature_of(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """fn's full signature: `types` for runtime arguments (pointers "*fp16", scalars "i32"), constexprs marked
    (those given and the defaulted ones)."""
    constexprs = with_defaults(fn, constexprs)
    return {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}


def compile_cuda(fn, types: dict[str, str], constexprs: dict, num_warps: int, capability: int = 90,
                 maxnreg: int | None = None, enable_fp_fusion: bool = True):
    """The compiled kernel (asm dict: ttgir, ptx, cubin) of a @gluon.jit or @triton.jit function. Pointer
    arguments are assumed 16-byte aligned, as a launch with torch tensors specializes them; enable_fp_fusion:
    the launch option of that name (False: no fused multiply-adds)."""
    constexprs = with_defaults(fn, constexprs)
    sig = signature_of(fn, types, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    src = Source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = ({"num_warps": num_warps, "enable_fp_fusion": enable_fp_fusion}
               | ({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread, stack (spill) bytes and shared memory of the cubin's kernel (cuobjdump -res-usage)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return {"registers": int(m[1]), "stack": int(m[2]), "shared": int(m[3]), "local": int(m[4])}


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            rows.append((int(m[1], 16), m[2]))
    return rows


def opcode(text: str) -> str:
    """The opcode of an instruction, predicate and modifiers dropped: '@!P0 LDG.E.64 R2, ...' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loop_histogram(rows: list[tuple[int, str]], marker: str) -> Counter:
    """Opcode counts of the innermost loop (a backward branch's range) whose body contains `marker`."""
    best = None
    for addr, text in rows:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m[1], 16) < addr:
            lo = int(m[1], 16)
            body = [t for a, t in rows if lo <= a <= addr]
            if any(marker in t for t in body) and (best is None or addr - lo < best[1] - best[0]):
                best = (lo, addr)
    if best is None:
        return Counter()
    return Counter(opcode(t) for a, t in rows if best[0] <= a <= best[1])


def _constexpr(v):
    """A constexpr as a job gives it: {"tl_dtype": "bf16"} is a Triton dtype (a job travels as JSON), else v."""
    if isinstance(v, dict) and set(v) == {"tl_dtype"}:
        import triton.language as tl

        return tl.dtype(v["tl_dtype"])
    return v


def report(module: str, kernel: str, types: dict[str, str], constexprs: dict, num_warps: int,
           maxnreg: int | None = None, loop_marker: str | None = None, enable_fp_fusion: bool = True) -> dict:
    """Compile module.kernel for sm_90: {"resources": resources(), "loop": loop_histogram(marker) or {},
    "opcodes": the whole kernel's opcode counts}. A dtype constexpr is given as {"tl_dtype": name}."""
    constexprs = {k: _constexpr(v) for k, v in constexprs.items()}
    fn = getattr(importlib.import_module(module), kernel)
    k = compile_cuda(fn, types, constexprs, num_warps, maxnreg=maxnreg, enable_fp_fusion=enable_fp_fusion)
    rows = sass(k.asm["cubin"])
    loop = loop_histogram(rows, loop_marker) if loop_marker else Counter()
    return {"resources": resources(k.asm["cubin"]), "loop": dict(loop),
            "opcodes": dict(Counter(opcode(t) for _, t in rows)), "ptx_order": ptx_order(k.asm["ptx"])}


GLOBAL_ACCESS = ("ld.global", "st.global", "atom.", "red.", "cp.async", "ld.volatile.global", "multimem.")
GLOBAL_WRITE = ("st.global", "atom.", "red.", "multimem.")


def ptx_order(ptx: str) -> dict:
    """Line numbers in the PTX of the first griddepcontrol.wait, the first griddepcontrol.launch_dependents and
    the first global memory access (None where absent): a PDL kernel must wait before it touches memory. "store": the
    first global write (a store or an atomic), which follows the wait even where weights are loaded ahead of it."""
    first = {"wait": None, "launch_dependents": None, "global": None, "store": None}
    for i, line in enumerate(ptx.splitlines()):
        text = line.strip()
        if first["store"] is None and any(text.startswith(op) or f" {op}" in text.split("//")[0][:40]
                                          for op in GLOBAL_WRITE):
            first["store"] = i
        if first["wait"] is None and text.startswith("griddepcontrol.wait"):
            first["wait"] = i
        elif first["launch_dependents"] is None and text.startswith("griddepcontrol.launch_dependents"):
            first["launch_dependents"] = i
        elif first["global"] is None and any(text.startswith(op) or f" {op}" in text.split("//")[0][:40]
                                             for op in GLOBAL_ACCESS):
            first["global"] = i
    return first


def report_in_subprocess(jobs: list[dict]) -> list[dict]:
    """report(**job) for each job, in one fresh `python -m moec.kernels.aot` process (TRITON_INTERPRET unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "moec.kernels.aot"], input=json.dumps(jobs), capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"moec.kernels.aot failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps([report(**job) for job in json.loads(sys.stdin.read())]))
