"""What an output records about where it was made: its timestamp and the software and device that made it.

On a CPU, calibration and packing are deterministic on one machine: the same inputs and seed give the
same bytes (tests/calibrate/test_resume.py checks it end to end), the time fields excepted. Those come from
`SOURCE_DATE_EPOCH` when it is set (the reproducible-builds convention), so two runs can give identical
manifests too. What can still change the bytes between machines is recorded in `environment()`: the
torch, triton and transformers versions, the device, and the CPU thread count (reductions of a matmul
are split by thread, so fp32 sums can round differently with another OMP_NUM_THREADS).

On a GPU (from reading the code; not measured here): the calibration forward pass, the statistics it
captures (Hessian sums by addmm, token counts, KV ranges and samples) and the nuq KV fit (on CPU samples)
give the same bits run to run on one GPU model, driver and torch build: cuBLAS matmuls are bit-stable there,
and the MoE combine's index_add_ adds each token once per expert call, so its atomics never race. Three
steps are not: the hls codebook update (hls.py, scatter_add_), rvq k-means (kmeans.py, index_add_) and the
tuning step's backward add floats with CUDA atomics in an order that changes from run to run, so hls and
rvq fits, and tuned codebooks, differ in their last bits between GPU runs.
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata


def created_timestamp() -> str:
    """UTC ISO-8601 time of now, or of `SOURCE_DATE_EPOCH` (seconds since the epoch) when set."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is not None:
        try:
            t = int(epoch)
        except ValueError:
            from .errors import UserError

            raise UserError(f"SOURCE_DATE_EPOCH must be an integer number of seconds, got {epoch!r}") from None
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_name(device: str) -> str:
    """'cpu (x86_64)' or 'cuda (NVIDIA H200)': the device kind and the hardware behind it."""
    if device.startswith("cuda"):
        import torch

        return f"cuda ({torch.cuda.get_device_name(device)})" if torch.cuda.is_available() else device
    return f"{device} ({platform.machine()})"


def environment(device: str) -> dict:
    """The software versions and device an output was computed with (read from package metadata, so
    nothing heavy is imported)."""
    import torch

    return {"torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
            "python": platform.python_version(), "device": device_name(device), "threads": torch.get_num_threads()}
