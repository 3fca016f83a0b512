"""Resumable calibration: the partial state `moec calibrate` saves as it goes, and `--resume`.

After every decoder layer, and after each step that follows the layer loop (codebook tuning, the KV
codec's fit), calibrate.run saves a checkpoint into OUT.partial/ beside the output directory:
    state.json                  what was done (stage, last completed layer), the run's key (below),
                                the JSON part of every observer's state (report entries, counts)
    state-NNNNN.safetensors     the tensors: the hidden states entering the next layer, every observer's
                                tensors (token counts, KV ranges, KV samples, fitted expert tensors),
                                the RNG states (the global torch generator, the KV sampler's)
A checkpoint is a new safetensors file, then state.json replaced by rename (its one atomic step), then
the older file removed: a kill at any point leaves the last complete checkpoint readable. No pickle.
Restoring every observer, the hidden states and the RNG states exactly makes a resumed run compute
the same bytes as one that was never interrupted (tests/calibrate/test_resume.py kills one to check).
Each checkpoint holds the whole state so far (the hidden states, samples × seq_len × dim fp32, and the KV
samples, up to 3 × 4096 tokens × K × d fp32 per layer, are most of it); it replaces the one before, so
the disk holds at most two at a time.

The key: a resume continues only the run it interrupted. The model (weight and config hashes), the
resolved recipe (seed aside, compared on its own), data and split, seed, samples, seq_len, a hash of
the calibration tokens (the data's content), the moec version and a hash of its source, the torch
version and the device are recorded; any difference is refused, naming each field that differs.

Without --resume, a partial state is refused (it is work a user would not want lost silently); with
--resume and none, calibration starts from the first layer (so scripts can always pass --resume).
A successful calibration removes OUT.partial/.

Observers take part through `state_dict()` -> {str: tensor or JSON value} and `load_state_dict(sd)`
(capture.ExpertTokenCounts, capture.KVRange, nuq.KVSampler, latent.LatentSampler,
fit_experts.ExpertFitter). The Hessian observers hold nothing across a layer boundary (the caller
flushes them at each layer's end), so they need neither. A KV sampler without the pair (a plugin codec)
turns checkpoints off with a warning.

MOEC_TEST_KILL_AFTER=<checkpoint> (layer-<i>, tune, kv-fit) makes the process SIGKILL itself right after
saving that checkpoint: the tests' way to interrupt a run at a known point; unset, it does nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import __version__
from ..errors import UserError
from ..provenance import device_name

log = logging.getLogger(__name__)

FORMAT, VERSION = "moec-calib-partial", 1
INDEX = "state.json"
KILL_ENV = "MOEC_TEST_KILL_AFTER"
STAGES = ("layers", "tune", "kv-fit")  # in the order calibrate runs them


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def source_hash() -> str:
    """sha256 (16 hex) over the path and bytes of every .py file of the moec package: the code version."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_key(fingerprint: dict, recipe, data: str, split: str, tokens: torch.Tensor, seed: int, samples: int,
            seq_len: int, device: str) -> dict:
    """What a resume must match, field by field (values short enough to print in a refusal)."""
    resolved = recipe.to_dict()
    resolved.get("calibration", {}).pop("seed", None)  # the seed is a field of its own
    return {"model": _sha((fingerprint["weights_sha256"] + fingerprint["config_sha256"]).encode()),
            "recipe": f"{recipe.name}@{_sha(json.dumps(resolved, sort_keys=True).encode())}",
            "data": f"{data}/{split}", "seed": seed, "samples": samples, "seq_len": seq_len,
            "tokens": _sha(tokens.to(torch.int64).contiguous().numpy().tobytes()),
            "code": f"moec {__version__} source {source_hash()}", "torch": torch.__version__,
            "device": device_name(device)}


def differences(saved: dict, now: dict) -> list[str]:
    """'seed 0 → 1' for each field that differs. The token hash follows from data, split, seed, samples
    and seq_len; it is named only when they all agree (then the data's content changed)."""
    diffs = [f"{k} {saved.get(k)} → {v}" for k, v in now.items() if k != "tokens" and saved.get(k) != v]
    upstream = ("data", "seed", "samples", "seq_len")
    if saved.get("tokens") != now["tokens"] and not any(saved.get(k) != now[k] for k in upstream):
        diffs.append(f"calibration tokens {saved.get('tokens')} → {now['tokens']} (the data's content changed)")
    return diffs


@dataclass
class Resumed:
    """What a checkpoint restores beyond the observers: where the run stopped and the step outputs."""

    stage: str
    layer: int  # last completed layer
    hidden: torch.Tensor | None  # [N, L, D] entering layer + 1 (stage "layers" only)
    elapsed: float  # seconds of capture and fitting spent before the interruption
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # step outputs (the KV fit's tensors)
    meta: dict = field(default_factory=dict)  # step outputs (the KV fit's report)

    def done(self, stage: str) -> bool:
        """Whether `stage` (a post-loop step) was completed before the interruption."""
        return STAGES.index(self.stage) >= STAGES.index(stage)


class PartialState:
    """The checkpoints of one calibration into `out`; `parts` are the observers to save and restore."""

    def __init__(self, out: Path, key: dict, parts: dict):
        self.dir, self.key = partial_dir(out), key
        self.parts = {name: p for name, p in parts.items() if p is not None}
        self.seq = 0
        stateless = [name for name, p in self.parts.items() if not hasattr(p, "state_dict")]
        self.enabled = not stateless
        if stateless:
            log.warning("%s cannot save its state: this calibration cannot be resumed if interrupted",
                        ", ".join(f"{name} ({type(self.parts[name]).__name__})" for name in stateless))

    def open(self, resume: bool) -> Resumed | None:
        """The checkpoint to continue from (observers and RNG states restored), or None: start fresh."""
        index = self.dir / INDEX
        if not index.is_file():  # none, or a first save killed before its index: nothing to continue
            if resume:
                log.info("--resume: no partial state at %s; calibrating from the first layer", self.dir)
            shutil.rmtree(self.dir, ignore_errors=True)
            return None
        try:
            state = json.loads(index.read_text())
            assert state["format"] == FORMAT, state["format"]
        except (ValueError, KeyError, AssertionError):
            raise UserError(f"{index}: not a moec partial calibration state; delete {self.dir}") from None
        if not resume:
            _refuse(self.dir, state)
        if state["version"] != VERSION:
            raise UserError(f"cannot resume from {self.dir}: partial state version {state['version']}, this moec "
                            f"reads {VERSION}; delete {self.dir} to start over")
        diffs = differences(state["key"], self.key)
        if diffs:
            raise UserError(f"cannot resume from {self.dir}: {', '.join(diffs)}; run with the original settings, "
                            f"or delete {self.dir} to start over")
        tensors = load_file(str(self.dir / state["tensors"]))
        for name, meta in state["parts"].items():
            own = {k.removeprefix(f"{name}/"): t for k, t in tensors.items() if k.startswith(f"{name}/")}
            self.parts[name].load_state_dict({**own, **meta})
        for name in set(self.parts) - set(state["parts"]):  # dropped once used (the KV sampler after its fit)
            del self.parts[name]
        torch.set_rng_state(tensors["rng/torch"])
        if "rng/cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng/cuda"])
        self.seq = state["seq"]
        log.info("resuming from %s: %s", self.dir, _progress(state))
        return Resumed(state["stage"], state["layer"], tensors.get("hidden"), state["elapsed"],
                       {k.removeprefix("step/"): t for k, t in tensors.items() if k.startswith("step/")},
                       state["step"])

    def save(self, stage: str, layer: int, elapsed: float, hidden: torch.Tensor | None = None,
             step_tensors: dict | None = None, step_meta: dict | None = None) -> None:
        """Checkpoint everything done so far (see the module docstring for why this order is atomic)."""
        if not self.enabled:
            return
        tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            tensors["rng/cuda"] = torch.cuda.get_rng_state()
        if hidden is not None:
            tensors["hidden"] = hidden
        tensors.update({f"step/{k}": t for k, t in (step_tensors or {}).items()})
        parts_meta = {}
        for name, p in self.parts.items():
            parts_meta[name] = {}
            for k, v in p.state_dict().items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{name}/{k}"] = v
                else:
                    parts_meta[name][k] = v
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seq += 1
        name = f"state-{self.seq:05d}.safetensors"
        save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(self.dir / name),
                  metadata={"format": FORMAT})
        index = {"format": FORMAT, "version": VERSION, "key": self.key, "stage": stage, "layer": layer,
                 "elapsed": elapsed, "seq": self.seq, "tensors": name, "parts": parts_meta, "step": step_meta or {}}
        tmp = self.dir / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        for f in (self.dir / name, tmp):
            _fsync(f)
        os.replace(tmp, self.dir / INDEX)
        _fsync(self.dir)
        for old in self.dir.glob("state-*.safetensors"):
            if old.name != name:
                old.unlink()
        label = f"layer-{layer}" if stage == "layers" else stage
        if os.environ.get(KILL_ENV) == label:  # tests only: interrupt the run at a known point
            os.kill(os.getpid(), signal.SIGKILL)

    def drop(self, name: str) -> None:
        """Stop saving part `name` (no later step needs it)."""
        self.parts.pop(name, None)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def refuse_without_resume(out: Path) -> None:
    """A partial state at `out` without --resume: refused before any work (hashing the weights can take
    minutes); PartialState.open checks it again."""
    index = partial_dir(out) / INDEX
    if index.is_file():
        try:
            state = json.loads(index.read_text())
        except ValueError:
            state = {}
        _refuse(partial_dir(out), state)


def _refuse(path: Path, state: dict):
    raise UserError(f"{path} holds an interrupted calibration ({_progress(state)}); pass --resume to continue "
                    f"it, or delete {path} to start over")


def _progress(state: dict) -> str:
    if state.get("stage") == "layers":
        return f"layers 0..{state.get('layer')} done"
    return f"all layers and the {state.get('stage')} step done"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
