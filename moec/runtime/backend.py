"""Which path a decode step takes: the fused Triton kernels or the torch reference.

By default the kernels run on CUDA and the torch reference everywhere else. `MOEC_KERNELS` overrides
that choice for every cache and codec at once, so the CPU test suite can drive the *default* kernel
path (the one a user gets on the GPU) under `TRITON_INTERPRET=1`, and a GPU run can take the torch
oracle without touching any constructor argument:

    MOEC_KERNELS=auto   (or unset) kernels on CUDA only; Gluon kernels where one serves the case
    MOEC_KERNELS=tl     as auto, but the Triton `tl` kernels only: the reference and fallback of every
                        Gluon kernel (Gluon has no CPU interpreter, so `tl` is what CI runs)
    MOEC_KERNELS=gluon  as auto, but a Gluon kernel wherever one supports the case, also where the `tl`
                        kernel was measured faster (the GPU smoke checks the Gluon path with it)
    MOEC_KERNELS=1      kernels wherever a codec has one; on the CPU this needs TRITON_INTERPRET=1
    MOEC_KERNELS=0      the torch reference, CUDA included

A cache's own conditions (shapes a kernel supports) still apply on top of this switch.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..errors import UserError

_CHOICES = ("auto", "tl", "gluon", "1", "0")


def kernel_mode() -> str:
    mode = os.environ.get("MOEC_KERNELS", "auto").strip().lower() or "auto"
    mode = {"on": "1", "true": "1", "off": "0", "false": "0"}.get(mode, mode)
    if mode not in _CHOICES:
        raise UserError(f"MOEC_KERNELS={os.environ['MOEC_KERNELS']!r}: expected auto, tl, gluon, 1 or 0")
    return mode


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_enabled(device) -> bool:
    """Whether the fused kernels are the default path for tensors on `device`."""
    mode = kernel_mode()
    if mode == "0":
        return False
    cuda = torch.device(device).type == "cuda"
    if mode in ("auto", "tl", "gluon"):
        return cuda
    if not cuda and not interpreting():
        raise UserError("MOEC_KERNELS=1 on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return True


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream; False on a CPU-only torch build, whose
    torch.cuda.is_current_stream_capturing raises instead of answering (a kernel that fails under Triton's
    interpreter must fall back there, not crash)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def gluon_enabled(device) -> bool:
    """Whether a Gluon kernel may serve a launch on `device`: CUDA, not the interpreter, MOEC_KERNELS not tl."""
    return torch.device(device).type == "cuda" and not interpreting() and kernel_mode() in ("auto", "gluon", "1")


def gluon_forced() -> bool:
    """MOEC_KERNELS=gluon: a Gluon kernel wherever it supports the case, whichever was measured faster."""
    return kernel_mode() == "gluon"


def gluon_chosen(device, measured_faster: bool) -> bool:
    """Whether a launch on `device` takes a Gluon kernel that supports its case: Gluon allowed there and either
    MOEC_KERNELS=gluon or the kernel measured faster than its `tl` counterpart (the caller's evidence)."""
    return gluon_enabled(device) and (gluon_forced() or measured_faster)


@contextmanager
def kernels_forced(mode: str):
    """Run a block with MOEC_KERNELS=mode (one of auto, tl, 1, 0), restoring the caller's setting after."""
    assert mode in _CHOICES, mode
    old = os.environ.get("MOEC_KERNELS")
    os.environ["MOEC_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["MOEC_KERNELS"]
        else:
            os.environ["MOEC_KERNELS"] = old
