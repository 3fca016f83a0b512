"""Expert-parallel calibration over torch.distributed (NCCL on GPUs, gloo on CPUs).

Every rank runs the same layer forward on the same tokens (the hidden states are identical on every
rank), but accumulates Hessians for and fits only its share of a layer's experts: expert e on rank
e % world (`owned`). After each layer the fitted parts and report entries of ranks 1.. are gathered
to rank 0, which interleaves them back into [E, ...] tensors; rank 0 alone writes the checkpoints
(resume.py) and the output, and runs the post-loop steps (codebook tuning, the KV codec's fit).
Fitting is per expert and each expert's Hessian sums the same tokens in the same order as in one
process, so the output is byte-identical to a one-process run (tests/calibrate/test_distributed.py).

Why safetensors bytes in a uint8 tensor, not gather_object: gather_object unpickles what another
process sent; safetensors carries tensors plus a JSON header and cannot execute code, which is the
same rule moec applies to files (tests/test_no_pickle.py). The sizes are exchanged first, the
payloads padded to the largest and gathered with `dist.gather` (gloo and NCCL both have it).

Launch: `torchrun --nproc-per-node N -m moec.cli.app calibrate ...` (WORLD_SIZE/RANK/LOCAL_RANK and
MASTER_ADDR/MASTER_PORT from the environment), or `moec calibrate --gpus N`, which starts the same N
processes itself (`launch`). A rank that dies makes the collectives of the others fail (gloo: the
connection closes; otherwise the process group's timeout, MOEC_DIST_TIMEOUT seconds, default 1800);
the run stops with one line, and `--resume` continues from rank 0's last checkpoint, with any number
of processes (the world size is not part of the run's key: the output does not depend on it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import UserError

TIMEOUT_ENV = "MOEC_DIST_TIMEOUT"


class RankLost(UserError):
    """A collective failed: another rank of the run stopped (killed, out of memory, an error)."""


@dataclass
class Dist:
    """This process's place in the run; by default the one-process run (no process group)."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where collectives move tensors (cuda for NCCL)
    grouped: bool = False  # in a process group (torchrun, --gpus; world 1 included: it runs the collectives)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def owned(self, n_experts: int) -> list[int]:
        """The experts this rank accumulates and fits (round robin, so every rank gets ⌊E/world⌋ or one more)."""
        return list(range(self.rank, n_experts, self.world))

    def _call(self, fn, *a):
        try:
            return fn(*a)
        except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
            raise RankLost(f"rank {self.rank}: lost contact with the other processes of the run "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); rerun with --resume to "
                           f"continue from the last checkpoint") from None

    def gather(self, tensors: dict[str, torch.Tensor], meta: dict) -> list[tuple[dict, dict]] | None:
        """Every rank's (tensors, meta) on rank 0, in rank order; None on the other ranks."""
        import torch.distributed as dist

        payload = st_save({k: t.cpu().contiguous() for k, t in tensors.items()},
                          metadata={"meta": json.dumps(meta)})
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        size = torch.tensor([buf.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._call(dist.all_gather, sizes, size)
        n = max(int(s.item()) for s in sizes)
        padded = torch.zeros(n, dtype=torch.uint8, device=self.device)
        padded[: buf.numel()] = buf.to(self.device)
        out = [torch.empty_like(padded) for _ in range(self.world)] if self.main else None
        self._call(dist.gather, padded, out, 0)
        if not self.main:
            return None
        got = []
        for t, s in zip(out, sizes, strict=True):
            raw = t[: int(s.item())].cpu().numpy().tobytes()
            got.append((st_load(raw), json.loads(_header_meta(raw)["meta"])))
        return got

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (the resume point; -1 says rank 0 stopped on an error)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._call(dist.broadcast, t, 0)
        return int(t.item())

    def broadcast(self, t: torch.Tensor | None, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Rank 0's tensor t (shape and dtype known to all) on every rank."""
        import torch.distributed as dist

        buf = (t.to(self.device, dtype).contiguous() if self.main
               else torch.empty(shape, dtype=dtype, device=self.device))
        self._call(dist.broadcast, buf, 0)
        return buf.cpu()

    def close(self) -> None:
        import torch.distributed as dist

        if self.grouped and dist.is_initialized():
            dist.destroy_process_group()


def _header_meta(raw: bytes) -> dict:
    """The __metadata__ of safetensors bytes (safetensors.torch.load drops it)."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])["__metadata__"]


def from_env(device: str) -> Dist:
    """The run's Dist: one process, or a process group from torchrun's environment variables."""
    if "WORLD_SIZE" not in os.environ:
        return Dist()
    world = int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local}: this machine has {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(local)  # "cuda" means this rank's GPU from here on
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (it needs what lent GPUs lack)
        backend, coll = "nccl", f"cuda:{local}"
    else:
        backend, coll = "gloo", "cpu"
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "1800")))
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return Dist(rank, world, coll, grouped=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, argv: list[str]) -> int:
    """Run `python -m moec.cli.app *argv` as n ranks on this machine (what torchrun would set up); the
    first nonzero exit status (128 + N for a rank killed by signal N), once every rank has stopped. A rank
    that fails makes the others fail at their next collective (gloo/NCCL see the closed connection), so
    none is left waiting."""
    env = dict(os.environ, WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-m", "moec.cli.app", *argv],
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]
    rc = 0
    while procs:
        for p in list(procs):
            code = p.poll()
            if code is None:
                continue
            procs.remove(p)
            if code and not rc:
                rc = code if code > 0 else 128 - code
        time.sleep(0.1)
    return rc
