"""The packed checkpoint, format `moec-packed` version 2 (version 1 is read: formats/kvsection.upgrade).

A directory:
    moec.json               manifest (below); readers check `format` and `format_version` first
    model-00001-of-000NN.safetensors   canonical tensors (no pickle anywhere), shards ≤ 2 GB
    config.json             the source HF config plus a compressed-tensors style `quantization_config`
    tokenizer files         copied from the source model

Manifest fields: format, format_version, moec_version, created (SOURCE_DATE_EPOCH when set), source
{model, path, config_sha256, weights_sha256}, model_args (moec.runtime.config.ModelArgs as a dict), recipe
(resolved), calibration (provenance: data, split, samples, seq_len, seed, token counts, the environment
that calibrated: moec/provenance.py), environment (the one that packed), tensors {name: {shard,
codec, bits, shape, dtype, bytes}}, shards {file: {sha256, bytes}}, effective_bits, kv (the KV codec's
section, formats/kvsection.py; null for an fp16 cache). Version 2 changed only the `kv` section.

Writes go through moec.atomic.atomic_dir (a temporary sibling directory renamed into place only when
complete), so a failed or killed pack never leaves a half-written checkpoint under the name. The reader
verifies version, presence and sha256 of every shard, then each tensor's shape and dtype, and names the
first thing that is wrong.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import __version__
from ..atomic import atomic_dir
from ..errors import FormatError, UserError
from ..provenance import created_timestamp
from . import kvsection

FORMAT = "moec-packed"
FORMAT_VERSION = 2
MANIFEST = "moec.json"
SHARD_BYTES = 2 << 30

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _shard(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += n
    if cur or not shards:
        shards.append(cur)
    return shards


def write_packed(out_dir: str | Path, tensors: dict[str, torch.Tensor], tensor_info: dict[str, dict],
                 manifest: dict, hf_config: dict, quantization_config: dict,
                 extra_files: Iterable[Path] = (), extra_texts: dict[str, str] | None = None) -> Path:
    """Write a packed checkpoint atomically. `tensor_info[name]` holds codec and bits per tensor."""
    out = Path(out_dir)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with atomic_dir(out, is_output=is_packed, what="a moec checkpoint", size_hint=size) as tmp:
        groups = _shard(tensors)
        entries, shard_meta = {}, {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in group.items()}, str(tmp / fname),
                      metadata={"format": FORMAT})  # one key: safetensors orders them by a per-process hash
            shard_meta[fname] = {"sha256": sha256_file(tmp / fname), "bytes": (tmp / fname).stat().st_size}
            for name, t in group.items():
                entries[name] = {"shard": fname, **tensor_info[name], "shape": list(t.shape),
                                 "dtype": dtype_name(t.dtype), "bytes": t.numel() * t.element_size()}
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, "moec_version": __version__,
                "created": created_timestamp(), **manifest,
                "tensors": entries, "shards": shard_meta}
        (tmp / MANIFEST).write_text(json.dumps(full, indent=1))
        cfg = dict(hf_config)
        cfg["quantization_config"] = quantization_config
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
        for fname, text in (extra_texts or {}).items():
            (tmp / fname).write_text(text)
    return out


def is_packed(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{p}: no such directory")
    mf = p / MANIFEST
    if not mf.is_file():
        raise FormatError(f"{p}: missing manifest {MANIFEST} (not a moec packed checkpoint)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise FormatError(f"{mf}: manifest is not valid JSON ({e.msg} at line {e.lineno})") from None
    if manifest.get("format") != FORMAT:
        raise FormatError(f"{mf}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError(f"{mf}: format_version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise FormatError(f"{mf}: format_version {version!r} is newer than this moec reads "
                          f"({FORMAT_VERSION}); upgrade moec")
    if manifest.get("kv") is not None:
        manifest["kv"] = kvsection.check(kvsection.upgrade(manifest["kv"], version))
    return manifest


def verify(path: str | Path, manifest: dict | None = None) -> dict:
    """Check every shard's presence, size and sha256, and each tensor's shape and dtype."""
    p = Path(path)
    manifest = manifest or read_manifest(p)
    for fname, meta in manifest["shards"].items():
        f = p / fname
        if not f.is_file():
            raise FormatError(f"{p}: shard {fname} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise FormatError(f"{f}: {size} bytes, manifest says {meta['bytes']} (truncated or replaced shard)")
        if sha256_file(f) != meta["sha256"]:
            raise FormatError(f"{f}: sha256 mismatch (the shard's bytes changed since packing)")
    by_shard: dict[str, list[str]] = {}
    for name, e in manifest["tensors"].items():
        by_shard.setdefault(e["shard"], []).append(name)
    for fname, names in by_shard.items():
        with safe_open(p / fname, "pt") as h:
            present = set(h.keys())
            for name in names:
                if name not in present:
                    raise FormatError(f"{p / fname}: tensor {name!r} missing")
                sl = h.get_slice(name)
                want = manifest["tensors"][name]
                if list(sl.get_shape()) != want["shape"]:
                    raise FormatError(f"{p / fname}: tensor {name!r} has shape {list(sl.get_shape())}, "
                                      f"manifest says {want['shape']}")
                got_dtype = _safetensors_dtype(sl.get_dtype())
                if got_dtype != want["dtype"]:
                    raise FormatError(f"{p / fname}: tensor {name!r} has dtype {got_dtype}, "
                                      f"manifest says {want['dtype']}")
    return manifest


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "U8": "uint8", "I8": "int8",
              "I16": "int16", "I32": "int32", "I64": "int64", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}


def _safetensors_dtype(code: str) -> str:
    return _ST_DTYPES.get(code, code)


def load_tensors(path: str | Path, manifest: dict, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors by canonical name (all, or `names`), after `verify`."""
    p = Path(path)
    wanted = list(manifest["tensors"]) if names is None else list(names)
    out: dict[str, torch.Tensor] = {}
    by_shard: dict[str, list[str]] = {}
    for name in wanted:
        by_shard.setdefault(manifest["tensors"][name]["shard"], []).append(name)
    for fname, ns in by_shard.items():
        with safe_open(p / fname, "pt") as h:
            for n in ns:
                out[n] = h.get_tensor(n)
    return out
