"""Programmatic dependent launch (PDL) for the decode step's kernels, Hopper and later.

A batch-1 decode step is a chain of short kernels in one CUDA graph, and each one normally starts only after its
predecessor has finished and drained: a few microseconds a boundary, a hundred-odd boundaries a step. With PDL
(Triton's `launch_pdl=True`: the launch attribute programmaticStreamSerialization) a kernel may be scheduled as
soon as every program of its predecessor has executed `griddepcontrol.launch_dependents`; it then waits in
`griddepcontrol.wait` until the predecessor has completed and its writes are visible.

Every kernel wired here calls `begin(PDL)` (Triton) or `gluon_begin(PDL)` (Gluon) before its first load or store:
wait, then let its own successor be scheduled. Since nothing is read or written before the wait, memory is ordered
exactly as the stream orders it, whatever is launched around these kernels (torch's or cuBLAS's kernels either
trigger early themselves or count as triggering when they end). tests/kernels/test_pdl.py checks the PTX of every
wired kernel for the wait ahead of its first global access.

What it buys a kernel boundary was measured before wiring it (benchmarks/studies/pdl_chain.py, its result in
benchmarks/results/pdl_chain_h100.json). `MOEC_PDL=0` turns it off, which is also the A/B of the step.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "MOEC_PDL"


@triton.jit
def begin(PDL: tl.constexpr):
    """A kernel's first statement: wait for the predecessor's writes, then let the successor be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@gluon.jit
def gluon_begin(PDL: gl.constexpr):
    """`begin` for Gluon kernels (the same two PTX instructions)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device | str) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9.0 or later, not under the CPU
    interpreter, and MOEC_PDL not "0"."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def options(device: torch.device | str) -> dict:
    """Keyword arguments for a wired kernel's launch: {"PDL": True, "launch_pdl": True} where `enabled`, else none
    (the kernel's PDL constexpr defaults to False: the kernel compiles as without PDL)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {}
