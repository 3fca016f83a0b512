"""A lightweight tracker of live tensor bytes, for memory timelines of CPU runs (bench_calibrate_scale.py).

`LiveTensors` is a TorchDispatchMode: every op's output storage is counted once, by its address, until
the last tensor the mode saw on it is freed (weakref.finalize). It keeps the running total, the peak, the
peak per phase (`phase` is set by the caller: capture, stats, fit...) and, whenever the total passes the
previous peak by 2 %, a snapshot of the largest live storages labelled "phase:op shape dtype" -- which
phase hits the peak and which tensors are alive there. Storages made before the mode was entered are not
counted (the bench enters it before the layer loop, so they are only the token ids and global weights).
CUDA's own allocator statistics are better on the GPU; this is for the CPU, where there are none.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    def __init__(self, top: int = 10):
        super().__init__()
        self.top, self.phase = top, "setup"
        self.live: dict[int, list] = {}  # storage address -> [nbytes, label, tensors alive on it]
        self.bytes = self.peak = 0
        self.phase_peak: dict[str, int] = {}
        self.at_peak: list[tuple[int, str]] = []
        self.peak_phase = ""
        self._snap = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, func)
        return out

    def _track(self, t: torch.Tensor, func) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key == 0:
            return
        ent = self.live.get(key)
        if ent is None:
            name = getattr(func, "overloadpacket", func).__name__
            ent = self.live[key] = [st.nbytes(), f"{self.phase}:{name} {list(t.shape)} {str(t.dtype)[6:]}", 0]
            self.bytes += ent[0]
            self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), self.bytes)
            if self.bytes > self.peak:
                self.peak, self.peak_phase = self.bytes, self.phase
                if self.bytes > 1.02 * self._snap:
                    self._snap = self.bytes
                    self.at_peak = sorted(((v[0], v[1]) for v in self.live.values()), reverse=True)[: self.top]
        ent[2] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        ent = self.live.get(key)
        if ent is None:
            return
        ent[2] -= 1
        if ent[2] == 0:
            self.bytes -= ent[0]
            del self.live[key]

    def summary(self) -> dict:
        gb = 1e9
        return {"peak_gb": round(self.peak / gb, 3), "peak_phase": self.peak_phase,
                "phase_peak_gb": {k: round(v / gb, 3) for k, v in self.phase_peak.items()},
                "alive_at_peak": [f"{b / gb:.3f} GB {label}" for b, label in self.at_peak]}
