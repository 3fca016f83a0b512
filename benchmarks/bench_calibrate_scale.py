"""Calibration at a real MoE shape: N decoder layers of mixtral-8x7b (moec/runtime/config.py PRESETS) with
random weights generated per layer from a seed as the layer loop asks for them, so no checkpoint is read
or stored (the bf16 model is 93 GB, more than the GPU machine's disk holds). It runs the calibration's own
layer loop (capture.run_layers) with its observers: token counts, KV ranges, per-expert Hessians and the
recipe's expert fits (ExpertHessians → ExpertFitter.on_layer), expert parallel under torchrun.

    python3 -m benchmarks.bench_calibrate_scale --layers 2 --samples 64 --seq-len 512 --device cuda \\
        --out $OUT/calibrate_scale.json
    torchrun --nproc-per-node 2 -m benchmarks.bench_calibrate_scale --layers 2 ... --device cuda   # 2 GPUs
    OMP_NUM_THREADS=1 python3 -m benchmarks.bench_calibrate_scale --dry --out /tmp/scale.json      # CPU, toy
    OMP_NUM_THREADS=1 python3 -m benchmarks.bench_calibrate_scale --mid --device cpu --layers 1 --samples 8 \
        --seq-len 256 --trace          # CPU memory timeline: peak live tensor bytes per phase, what is alive

Record fields: shape, recipe, gpus (processes), layers, samples, seq_len, wall_s (the layer loop, fits included),
fit_s (the expert fits alone), extrapolated_layer_fit_s (fit_s per layer and expert × the shape's expert count:
with --experts N fewer than the shape's), tokens_per_s (samples × seq_len × layers / wall_s), peak_gpu_gb
(torch.cuda.max_memory_allocated of rank 0), one_layer_plus_act_gb (from the shapes, per rank: one layer's fp32
weights on the device, the hidden states, and rank 0's share of the statistics: E/world expert Hessians of D² + I²
fp32, plus the all-token H1 (D²) and H2 of its experts under all-experts-for-stats: 8 × 14336² fp32 alone is 6.6
GB), peak_host_gb (ru_maxrss of rank 0), extrapolated_model_wall_s (wall_s per layer × the shape's model_layers),
peak_ratio (the peak over one_layer_plus_act_gb: the GPU's allocator peak, or with --trace the peak of live CPU
tensor bytes), offload_activations (--offload-activations: the bound then counts one batch of hidden states),
memory_fraction (--memory-fraction: usable GPU memory capped at that many times one_layer_plus_act_gb), trace
(--trace: peak per phase and the largest tensors alive at the peak). Results are for random weights: routing is
near uniform, which is the costly case for per-expert statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import resource
import time
import weakref
from functools import lru_cache
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.benchutil import ROOT
from moec.calibrate import distributed
from moec.calibrate.capture import ExpertTokenCounts, KVRange, run_layers
from moec.calibrate.fit_experts import ExpertFitter, canonical_names, plan
from moec.calibrate.hessian import ExpertHessians
from moec.calibrate.recipe import load_recipe
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.config import PRESETS

# --dry: the mixtral layout at a size the CPU calibrates in seconds
TOY = dict(vocab_size=512, dim=128, n_heads=4, n_kv_heads=2, head_dim=32, expert_dim=192, max_seq_len=4096)
# --mid: a mixtral-like layer a quarter of the width (dim 1024, 8 experts of 3584), for CPU memory timelines
BATCH = 8  # run_layers' batch (sequences per forward)
MID = dict(vocab_size=4096, dim=1024, n_heads=8, n_kv_heads=2, head_dim=128, expert_dim=3584, max_seq_len=4096)


def random_layers(args, seed: int):
    """(global_state, layer_state): canonical tensors drawn from `seed` and the name, bf16 like a real
    checkpoint; one layer is held at a time (the capture loop, the Hessians and the fitter ask for the same
    layer in turn, hence the one-entry cache)."""
    names = canonical_names(args)

    def draw(name: str, shape: tuple, salt: int) -> torch.Tensor:
        if name.endswith("norm.weight"):  # RMSNorm gains
            return torch.ones(shape, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(seed * 1_000_003 + salt)
        fan_in = shape[-1]
        return (torch.randn(shape, generator=g) / fan_in**0.5).to(torch.bfloat16)

    glob = {n: draw(n, s, i) for i, (n, s) in enumerate(names.items()) if not n.startswith("layers.")}

    @lru_cache(maxsize=1)
    def layer_state(i: int) -> dict:
        prefix = f"layers.{i}."
        return {n: draw(n, s, j) for j, (n, s) in enumerate(names.items()) if n.startswith(prefix)}

    return glob, layer_state


def one_layer_plus_act_bytes(args, samples: int, seq_len: int, world: int, all_tokens: bool) -> int:
    """Rank 0's device bytes from the shapes: one layer's weights as the loop holds them (fp32), the hidden
    states [N, L, D] fp32 (with --offload-activations, pass N = run_layers' batch, what the device holds),
    and its share of the statistics (run_layers, hessian.ExpertHessians)."""
    names = canonical_names(args)
    layer = sum(torch.Size(s).numel() for n, s in names.items() if n.startswith("layers.0.")) * 4
    D, I, E = args.dim, args.expert_dim, args.n_experts
    mine = len(range(0, E, world))
    stats = mine * (D * D + I * I) * 4 + (D * D + mine * I * I) * 4 * all_tokens
    w13 = 2 * E * I * D * 4  # ExpertHessians' fp32 copy of w1, w3 (the down projection's inputs)
    return layer + w13 + samples * seq_len * D * 4 + stats


def label_phases(trace, observers: list, hessians) -> list:
    """Set trace.phase around the statistics observers, the fit and its quantizer steps (--trace)."""
    from moec.calibrate import fit_experts, hls

    def labelled(fn, phase):
        def call(*args, **kw):
            before, trace.phase = trace.phase, phase
            try:
                return fn(*args, **kw)
            finally:
                trace.phase = before
        return call

    for mod, name in ((hls, "fit_lut"), (hls, "gptq_assign"), (hls, "refit_lut"), (hls, "output_error"),
                      (fit_experts, "regularize")):
        setattr(mod, name, labelled(getattr(mod, name), f"fit:{name}"))
    hessians.on_layer = labelled(hessians.on_layer, "fit")
    trace.phase = "capture"
    return [labelled(ob, f"stats:{type(ob).__name__}") for ob in observers]


class LiveTensors(TorchDispatchMode):
    """A lightweight tracker of live tensor bytes, for memory timelines of CPU runs (--trace).

    A TorchDispatchMode: every op's output storage is counted once, by its address, until
    the last tensor the mode saw on it is freed (weakref.finalize). It keeps the running total, the peak, the
    peak per phase (`phase` is set by the caller: capture, stats, fit...) and, whenever the total passes the
    previous peak by 2 %, a snapshot of the largest live storages labelled "phase:op shape dtype" -- which
    phase hits the peak and which tensors are alive there. Storages made before the mode was entered are not
    counted (the bench enters it before the layer loop, so they are only the token ids and global weights).
    CUDA's own allocator statistics are better on the GPU; this is for the CPU, where there are none.
    """

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="mixtral-8x7b", choices=[k for k, v in PRESETS.items() if v.is_moe])
    ap.add_argument("--recipe", type=Path, default=ROOT / "moec/recipes/experts-hls2.yaml")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry", action="store_true", help="toy sizes on the CPU (checks the script, measures nothing)")
    ap.add_argument("--mid", action="store_true", help="dim 1024, expert_dim 3584 (CPU memory timelines)")
    ap.add_argument("--dim", type=int, default=None, help="override the shape's hidden size")
    ap.add_argument("--expert-dim", type=int, default=None, help="override the shape's expert width")
    ap.add_argument("--experts", type=int, default=None,
                    help="override the shape's expert count (a slow per-expert fit timed on fewer experts: the fits "
                         "loop over experts of one shape, so the record extrapolates the layer's fit time)")
    ap.add_argument("--trace", action="store_true",
                    help="track live tensor bytes per phase (LiveTensors below; slow, meant for the CPU)")
    ap.add_argument("--offload-activations", action="store_true",
                    help="hidden states of the calibration set in host memory, one batch on the device at a time")
    ap.add_argument("--memory-fraction", type=float, default=None,
                    help="cap usable GPU memory (torch.cuda.set_per_process_memory_fraction) to this many times "
                         "one_layer_plus_act_gb")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.dry:
        a.device, a.samples, a.seq_len, a.layers = "cpu", 4, 64, min(a.layers, 2)
    size = dict(TOY if a.dry else MID if a.mid else {})
    size.update({k: v for k, v in (("dim", a.dim), ("expert_dim", a.expert_dim), ("n_experts", a.experts))
                 if v is not None})
    args = dataclasses.replace(PRESETS[a.shape], n_layers=a.layers, ffn_kinds=[], **size)
    recipe = load_recipe(a.recipe)
    cal = recipe.calibration
    all_tokens = cal.expert_policy == "all-experts-for-stats" and cal.min_expert_tokens > 0
    dist = distributed.from_env(a.device)
    glob, layer_state = random_layers(args, a.seed)
    tokens = torch.randint(0, args.vocab_size, (a.samples, a.seq_len), generator=torch.Generator().manual_seed(a.seed))

    targets = plan(args, recipe)
    fitter = ExpertFitter(targets, layer_state, cal.expert_policy, cal.min_expert_tokens, dist=dist)
    hessians = ExpertHessians(args, fitter.layers(), layer_state, fitter.on_layer, all_tokens=all_tokens,
                              experts=dist.owned(args.n_experts) if dist.grouped else None)
    observers = [ExpertTokenCounts(args), KVRange(), hessians]
    on_device = min(a.samples, BATCH) if a.offload_activations else a.samples
    act_bytes = one_layer_plus_act_bytes(args, on_device, a.seq_len, dist.world, all_tokens)
    if a.device == "cuda":
        if a.memory_fraction is not None:
            dev = torch.cuda.current_device()
            cap = a.memory_fraction * act_bytes / torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(cap, 1.0), dev)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    trace = None
    if a.trace:
        trace = LiveTensors()
        observers = label_phases(trace, observers, hessians)
    t0 = time.time()
    with trace if trace is not None else contextlib.nullcontext():
        run_layers(args, glob, layer_state, tokens, observers, batch_size=BATCH, device=a.device,
                   on_layer_end=lambda i, h: hessians.flush(),
                   **({"offload": True} if a.offload_activations else {}))
    if a.device == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    dist.close()
    if not dist.main:
        return
    assert len(fitter.report) == a.layers and all(f"fit.layers.{i}.moe.w1.codes" in fitter.tensors
                                                  for i in range(a.layers)), sorted(fitter.tensors)[:4]
    rec = base_record("calibrate-scale", a.device) | {
        "shape": a.shape + (" (toy)" if a.dry else f" (dim {args.dim}, expert_dim {args.expert_dim}, "
                                                   f"{args.n_experts} experts)" if size else ""),
        "recipe": recipe.name, "gpus": dist.world, "layers": a.layers,
        "samples": a.samples, "seq_len": a.seq_len, "offload_activations": a.offload_activations,
        "wall_s": round(wall, 2),
        "fit_s": round(fitter.seconds, 2),  # the expert fits alone (inside wall_s)
        # the shape's own layer: its fit time scaled by its expert count (fits of one expert shape, one by one)
        "extrapolated_layer_fit_s": round(fitter.seconds / a.layers / args.n_experts * PRESETS[a.shape].n_experts, 1),
        "tokens_per_s": round(a.samples * a.seq_len * a.layers / wall, 1),
        # the whole model at this rate: every layer costs the same (same shapes, same token count)
        "model_layers": PRESETS[a.shape].n_layers,
        "extrapolated_model_wall_s": round(wall / a.layers * PRESETS[a.shape].n_layers, 1),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3) if a.device == "cuda" else None,
        "one_layer_plus_act_gb": round(act_bytes / 1e9, 3),
        "peak_host_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3),  # KiB on Linux
    }
    if a.device == "cuda":
        rec["peak_ratio"] = round(torch.cuda.max_memory_allocated() / act_bytes, 3)
        rec["memory_fraction"] = a.memory_fraction
    if trace is not None:
        rec["trace"] = trace.summary()
        rec["peak_ratio"] = round(trace.peak / act_bytes, 3)  # live CPU tensor bytes / the shapes' bound
    print(rec)
    if a.out is not None:
        write_json_atomic(a.out, [rec])


if __name__ == "__main__":
    main()
