"""Tuned launch constants as data: one JSON file per device, read at the first launch on that device
(as vLLM ships its fused-MoE configs, one file per device name).

    moec/kernels/configs/nvidia_h200.json    the defaults: the values tuned on the H200, used on every
                                             device without a file of its own and where there is no CUDA
                                             device (the CPU interpreter)
    moec/kernels/configs/<device>.json       a device's overrides, <device> = device_key(the CUDA device
                                             name): "NVIDIA H100 PCIe" -> nvidia_h100_pcie
    $MOEC_KERNEL_CONFIG_DIR/<device>.json    the same, outside the package (searched first): a sweep's output

A file maps kernel -> named config -> {launch knob: value} (null = chosen per call by the launcher), plus
"device" (name and streaming-multiprocessor count the defaults were tuned with) and keys starting with "_"
(notes: where the values were measured); a device file may give any subset of the defaults' kernels,
configs and knobs, and a knob the defaults lack is an error (a typo would otherwise be silently ignored).

The kernel modules expose the defaults under their old names (moe_decode.DECODE_CONFIG, qlinear.GEMV_CONFIG,
kv_decode_attention.CONFIG, ...): on a device without a file of its own (the H200 included) a launch uses
those very dicts, so a benchmark that edits one in place changes the launches; on a device with a file it
edits `config(kernel, device)[name]` instead. The sweeps (benchmarks/sweep_moe_decode.py,
sweep_qlinear.py) write a device file with `--write-config DIR` (write_overrides): the config that was best
on most of the swept shapes and batches; review it, then set MOEC_KERNEL_CONFIG_DIR=DIR to use it, or copy it
into moec/kernels/configs/ to ship it.

NUM_SMS: num_sms(device) is the device's multiprocessor count; without a CUDA device, the defaults'.
docs/kernel-configs.md says where each default was measured and how to tune a new device.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources

import torch

from ..errors import UserError

DEFAULT_KEY = "nvidia_h200"  # the device the defaults were tuned on (configs/nvidia_h200.json)
ENV_DIR = "MOEC_KERNEL_CONFIG_DIR"

_DEFAULTS: dict = {}
_BY_KEY: dict[str, dict] = {}  # device key -> merged config (the defaults' objects where nothing overrides)
_KEY_OF: dict[torch.device, str] = {}  # CUDA device -> its key (names are read once per device)
_SMS: dict[torch.device, int] = {}


def device_key(name: str) -> str:
    """A device name as a file name: lower case, runs of other characters as one '_'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def config_files():
    """The package's config directory (an importlib.resources Traversable: works from a wheel or a zip)."""
    return resources.files(__package__).joinpath("configs")


def _read(text: str, where: str) -> dict:
    """A device file's JSON object; a malformed one is a one-line UserError naming the file (it is input:
    $MOEC_KERNEL_CONFIG_DIR, a sweep's output)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def defaults() -> dict:
    """configs/nvidia_h200.json, parsed once (the same objects on every call)."""
    if not _DEFAULTS:
        f = config_files().joinpath(f"{DEFAULT_KEY}.json")
        _DEFAULTS.update(_read(f.read_text(), str(f)))
    return _DEFAULTS


def _merge(base: dict, over: dict, where: str) -> dict:
    """base with over's knobs replaced, kernel by kernel and config by config; untouched kernels keep
    base's objects. A kernel, config or knob that base lacks is an error naming it."""
    out = dict(base)
    for kernel, cfgs in over.items():
        if kernel.startswith("_"):
            continue
        if kernel == "device":
            out["device"] = base["device"] | cfgs
            continue
        if kernel not in base:
            raise UserError(f"{where}: unknown kernel {kernel!r} (known: {sorted(k for k in base if k[0] != '_')})")
        merged = dict(base[kernel])
        for name, knobs in cfgs.items():
            if name not in base[kernel]:
                raise UserError(f"{where}: {kernel}: unknown config {name!r} (known: {sorted(base[kernel])})")
            unknown = set(knobs) - set(base[kernel][name])
            if unknown:
                raise UserError(f"{where}: {kernel}.{name}: unknown knobs {sorted(unknown)}")
            merged[name] = base[kernel][name] | knobs
        out[kernel] = merged
    return out


def for_key(key: str) -> dict:
    """The whole config of device `key`: the defaults overridden by $MOEC_KERNEL_CONFIG_DIR/<key>.json, else
    by the package's configs/<key>.json, where one exists. Cached per key."""
    got = _BY_KEY.get(key)
    if got is not None:
        return got
    got = defaults()
    env = os.environ.get(ENV_DIR)
    path = os.path.join(env, f"{key}.json") if env else None
    if path and os.path.isfile(path):
        with open(path) as fh:
            got = _merge(got, _read(fh.read(), path), path)
    elif key != DEFAULT_KEY:
        f = config_files().joinpath(f"{key}.json")
        if f.is_file():
            got = _merge(got, _read(f.read_text(), str(f)), str(f))
    _BY_KEY[key] = got
    return got


def _cuda(device) -> torch.device | None:
    """The CUDA device a launch runs on, or None (CPU tensors, no device given, the Triton interpreter)."""
    if device is None or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def config(kernel: str, device=None) -> dict:
    """kernel's named launch configs for `device` (a torch.device, string or None): read from the device's
    file at the first launch on it, then cached."""
    dev = _cuda(device)
    if dev is None:
        return defaults()[kernel]
    key = _KEY_OF.get(dev)
    if key is None:
        key = _KEY_OF[dev] = device_key(torch.cuda.get_device_name(dev))
    return for_key(key)[kernel]


def num_sms(device=None) -> int:
    """Streaming multiprocessors of `device` (the grid-size heuristics' unit); the defaults' count (the
    H200's) where there is no CUDA device."""
    dev = _cuda(device)
    if dev is None:
        return int(defaults()["device"]["sms"])
    n = _SMS.get(dev)
    if n is None:
        n = _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def write_overrides(directory, device_name: str, kernel: str, name: str, knobs: dict) -> tuple[str, dict]:
    """Merge `knobs` into <directory>/<device_key(device_name)>.json under kernel.name (the file is created
    if absent, replaced atomically): how a sweep writes a device file. Knobs the defaults' config lacks are
    left out and returned, so a sweep's extra settings (e.g. a forced split) do not make the file invalid.
    Returns (path, the knobs left out)."""
    known = defaults()[kernel][name]
    kept = {k: v for k, v in knobs.items() if k in known}
    dropped = {k: v for k, v in knobs.items() if k not in known}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{device_key(device_name)}.json")
    data = {"device": {"name": device_name}}
    if os.path.isfile(path):
        with open(path) as fh:
            data = _read(fh.read(), path)
    data.setdefault(kernel, {}).setdefault(name, {}).update(kept)
    _merge(defaults(), data, path)  # refuse to write what the loader would refuse to read
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return path, dropped


def clear_cache() -> None:
    """Forget every file read (tests; a process that writes a device file and wants it used)."""
    _BY_KEY.clear()
    _KEY_OF.clear()
    _SMS.clear()


__all__ = ["DEFAULT_KEY", "ENV_DIR", "clear_cache", "config", "config_files", "defaults", "device_key", "for_key",
           "num_sms", "write_overrides"]
