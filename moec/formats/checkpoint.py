"""The packed checkpoint, format `moec-packed` version 3 (versions 2 and 1 are read: formats/kvsection.upgrade).

A directory:
    moec.json               manifest (below); readers check `format` and `format_version` first
    model-00001-of-000NN.safetensors   canonical tensors (no pickle anywhere), shards ≤ 2 GB
    model.safetensors.index.json   the standard shard index (every stored tensor -> its shard), derived from
                            the manifest and written beside it, so that transformers finds the shards
                            (`AutoModelForCausalLM.from_pretrained` with moec.hf's quantizer); checkpoints
                            packed before it lack it (moec.hf.from_pretrained reads those); moec reads the manifest
    config.json             derived (`hf_config_json`): the source HF config with `model_type` replaced by
                            MODEL_TYPE (transformers without moec refuses it, naming moec and the fix; the
                            source's is kept under SOURCE_MODEL_TYPE, and `import moec.hf` maps it back) and a
                            compressed-tensors style `quantization_config` mirroring the manifest's recipe
                            (`quant_method: "moec"`, the key transformers dispatches on). No moec reader
                            reads the mirror: the manifest is the one home of every recipe key.
    tokenizer files         copied from the source model

Manifest fields: format, format_version, moec_version, created (SOURCE_DATE_EPOCH when set), source
{model, path, config_sha256, weights_sha256}, model_args (moec.runtime.config.ModelArgs as a dict), recipe
(resolved: every recipe key, the KV codec's included, stored here only), calibration (provenance: data,
split, samples, seq_len, seed, token counts, the environment that calibrated: moec/provenance.py),
environment (the one that packed), tensors {name: {shard, codec, bits, shape, dtype, bytes}}, shards
{file: {sha256, bytes}}, effective_bits, kv (what the KV codec needs beyond its recipe keys: shapes,
tensor names, derived keys, formats/kvsection.py; null for an fp16 cache).
Version 3: recipe keys only in `recipe` (the `kv` section, `recipe.yaml`, the kv tensors' entries and
effective_bits.kv_bits_nominal no longer repeat them). Version 2 changed only the `kv` section.

Writes go through moec.atomic.atomic_dir (a temporary sibling directory renamed into place only when
complete), so a failed or killed pack never leaves a half-written checkpoint under the name. The reader
verifies version, presence and sha256 of every shard, then each tensor's shape and dtype, and names the
first thing that is wrong.

Checkpoints travel between people, so the reader treats one as untrusted (tests/formats/test_fuzz_checkpoint.py):
the manifest's fields are type-checked before use (`check_manifest`), shard names are plain file names
and a shard may not be a link leading out of the directory (nothing outside it is read), and a
safetensors header that the library refuses is a FormatError like any other. Hashes guard against
accidents, not attackers (whoever edits a shard can edit its hash), so no check relies on them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import __version__
from ..atomic import atomic_dir
from ..errors import FormatError, UserError
from ..progress import track, tracked
from ..provenance import created_timestamp
from . import kvsection

FORMAT = "moec-packed"
FORMAT_VERSION = 3
MANIFEST = "moec.json"
HF_INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30
# config.json's model_type: one that transformers does not know, so that a tool which did not import moec
# refuses the directory (transformers quotes it in its error) instead of loading a randomly initialised
# model; `import moec.hf` registers it (moec/hf/load.py) and maps it back to the source's, kept under
# SOURCE_MODEL_TYPE, whatever that architecture is
MODEL_TYPE = "moec-packed (load it with moec: pip install moec; then import moec.hf, or moec.hf.from_pretrained(DIR))"
SOURCE_MODEL_TYPE = "moec_source_model_type"

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, track(f"hashing {Path(path).name}", os.fstat(f.fileno()).st_size, "B") as advance:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
            advance(len(chunk))
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
                 manifest: dict, hf_config: dict, extra_files: Iterable[Path] = (),
                 load: Callable[[str], torch.Tensor] | None = None) -> Path:
    """Write a packed checkpoint atomically. `tensor_info[name]` holds codec and bits per tensor; `hf_config`
    is the source's HF config (config.json is derived from it and the manifest: `hf_config_json`).

    Streamed: with `load`, `tensors` may hold meta tensors (shapes and dtypes only, which plan the
    shards) and load(name) reads the data when its shard is written, so only one shard's tensors are
    held at a time; the files are the same bytes as with the tensors in memory."""
    out = Path(out_dir)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with atomic_dir(out, is_output=is_packed, what="a moec checkpoint", size_hint=size) as tmp:
        groups = _shard(tensors)
        entries, shard_meta = {}, {}
        for i, group in tracked(enumerate(groups), f"writing {out.name}", len(groups), "shards"):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            data = {k: _loaded(k, v, load).contiguous() for k, v in group.items()}
            part = tmp / (fname + ".partial")  # each shard complete under its name, the manifest last
            save_file(data, str(part), metadata={"format": FORMAT})  # one key: safetensors orders them by a hash
            del data
            os.replace(part, tmp / fname)
            shard_meta[fname] = {"sha256": sha256_file(tmp / fname), "bytes": (tmp / fname).stat().st_size}
            for name, t in group.items():
                entries[name] = {"shard": fname, **tensor_info[name], "shape": list(t.shape),
                                 "dtype": dtype_name(t.dtype), "bytes": t.numel() * t.element_size()}
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, "moec_version": __version__,
                "created": created_timestamp(), **manifest,
                "tensors": entries, "shards": shard_meta}
        (tmp / MANIFEST).write_text(json.dumps(full, indent=1))
        index = {"metadata": {"format": FORMAT, "total_size": sum(e["bytes"] for e in entries.values())},
                 "weight_map": {name: e["shard"] for name, e in entries.items()}}
        (tmp / HF_INDEX).write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(hf_config_json(hf_config, full), indent=1))
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
    return out


def quantization_config(manifest: dict) -> dict:
    """config.json's `quantization_config`, derived from the manifest (its one source): compressed-tensors
    style, for tools that display what a checkpoint is, and `quant_method` for transformers' dispatch to
    moec.hf's quantizer. A mirror: no moec reader reads it."""
    recipe = manifest.get("recipe") or {}
    groups = {}
    for i, r in enumerate(recipe.get("weights") or []):
        group = r.get("group_size") or None
        groups[f"group_{i}"] = {"targets": r.get("targets"), "weights": {
            "codec": r.get("codec"), "num_bits": r.get("bits"), "group_size": group,
            "strategy": "group" if group else "channel"}}
    kv = recipe.get("kv") if manifest.get("kv") is not None else None
    return {"quant_method": "moec", "format": FORMAT, "format_version": FORMAT_VERSION,
            "layout": manifest.get("layout", "canonical"), "config_groups": groups,
            "kv_cache_scheme": None if kv is None else {"codec": kv.get("codec"), "num_bits": kv.get("bits"),
                                                        "window": kv.get("window"), "sinks": kv.get("sinks")},
            "ignore": [], "w_bits": (manifest.get("effective_bits") or {}).get("w_bits")}


def hf_config_json(hf_config: dict, manifest: dict) -> dict:
    """The packed directory's config.json: the source's HF config, its model_type moved to SOURCE_MODEL_TYPE
    and replaced by MODEL_TYPE, plus `quantization_config(manifest)`. `source_hf_config` inverts it."""
    cfg = {k: v for k, v in hf_config.items() if k not in ("quantization_config", SOURCE_MODEL_TYPE)}
    cfg[SOURCE_MODEL_TYPE] = source_model_type(hf_config)
    cfg["model_type"] = MODEL_TYPE
    cfg["quantization_config"] = quantization_config(manifest)
    return cfg


def source_model_type(cfg: dict):
    """The source architecture's model_type of a packed config.json (or of a plain HF config)."""
    return cfg.get(SOURCE_MODEL_TYPE) if cfg.get("model_type") == MODEL_TYPE else cfg.get("model_type")


def source_hf_config(cfg: dict) -> dict:
    """The source's HF config from a packed directory's config.json (any version: before format 3 the
    model_type was the source's): the mirror and the marker removed."""
    out = {k: v for k, v in cfg.items() if k not in ("quantization_config", SOURCE_MODEL_TYPE)}
    if "model_type" in cfg:
        out["model_type"] = source_model_type(cfg)
    return out


def _loaded(name: str, t: torch.Tensor, load: Callable[[str], torch.Tensor] | None) -> torch.Tensor:
    if load is None or not t.is_meta:
        return t
    v = load(name)
    assert v.shape == t.shape and v.dtype == t.dtype, (name, v.shape, v.dtype, t.shape, t.dtype)
    return v


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
    kvsection.upgrade(manifest, version)
    if manifest.get("kv") is not None:
        try:
            recipe = manifest.get("recipe")
            kvsection.check(manifest["kv"], recipe.get("kv") if isinstance(recipe, dict) else None)
        except FormatError as e:
            raise FormatError(f"{mf}: {e}") from None
    return manifest


# torch dtypes a packed tensor may have (the manifest's `dtype` names), by safetensors' code
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "U8": "uint8", "I8": "int8",
              "I16": "int16", "I32": "int32", "I64": "int64", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}
_DTYPES = tuple(_ST_DTYPES.values())
# the keys a model's manifest holds beyond the container's `tensors` and `shards`, with their JSON types
_MODEL_FIELDS = {"model_args": dict, "source": dict, "recipe": dict, "calibration": dict, "effective_bits": dict}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_shape(v) -> bool:
    return isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v)


def is_plain_file_name(name) -> bool:
    """A file directly inside the checkpoint directory: no separator, no `..`, nothing absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def check_manifest(m: dict, where: str | Path = MANIFEST) -> None:
    """The container's fields (`tensors`, `shards`) have the types the reader expects (FormatError naming
    the first that does not): a manifest from elsewhere is input like any other."""
    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: {what}")

    for key in ("tensors", "shards"):
        if not isinstance(m.get(key), dict):
            raise bad(f"{key!r} must be a JSON object, got {type(m.get(key)).__name__}")
    for fname, meta in m["shards"].items():
        if not is_plain_file_name(fname):
            raise bad(f"shard name {fname!r} is not a plain file name inside the checkpoint directory")
        if not isinstance(meta, dict) or not _is_int(meta.get("bytes")) or meta["bytes"] < 0 \
                or not isinstance(meta.get("sha256"), str) or len(meta["sha256"]) != 64:
            raise bad(f"shards[{fname!r}] must be {{sha256: 64 hex digits, bytes: int >= 0}}, got {meta!r}")
    if not m["tensors"]:
        raise bad("no tensors")
    for name, e in m["tensors"].items():
        if not isinstance(e, dict):
            raise bad(f"tensors[{name!r}] must be a JSON object, got {type(e).__name__}")
        if not isinstance(e.get("shard"), str) or e["shard"] not in m["shards"]:
            raise bad(f"tensors[{name!r}].shard {e.get('shard')!r} is not one of the manifest's shards")
        if not isinstance(e.get("codec"), str) or not _is_int(e.get("bits")) or not isinstance(e.get("param"), str):
            raise bad(f"tensors[{name!r}]: codec and param must be strings and bits an int, got codec "
                      f"{e.get('codec')!r}, param {e.get('param')!r}, bits {e.get('bits')!r}")
        if e.get("dtype") not in _DTYPES:
            raise bad(f"tensors[{name!r}].dtype {e.get('dtype')!r} is not one of {', '.join(_DTYPES)}")
        for key in ("shape", "param_shape"):
            if (key == "shape" or key in e) and not _is_shape(e.get(key)):
                raise bad(f"tensors[{name!r}].{key} must be a list of ints >= 0, got {e.get(key)!r}")
        if "group_size" in e and not (_is_int(e["group_size"]) and e["group_size"] >= 0):
            raise bad(f"tensors[{name!r}].group_size must be an int >= 0, got {e['group_size']!r}")
        if not (_is_int(e.get("bytes")) and e["bytes"] >= 0):
            raise bad(f"tensors[{name!r}].bytes must be an int >= 0, got {e.get('bytes')!r}")


def check_model_fields(m: dict, where: str | Path = MANIFEST) -> None:
    """The model-level fields that the runtime and `moec inspect` read have their JSON types (FormatError)."""
    for key, tp in _MODEL_FIELDS.items():
        if key == "model_args" and m.get("layout") == "hf":  # the transformers path: config.json describes it
            continue
        if not isinstance(m.get(key), tp):
            raise FormatError(f"{where}: {key!r} must be a JSON object, got {type(m.get(key)).__name__}")
    if not isinstance(m["source"].get("model"), str) or not isinstance(m["recipe"].get("name"), str):
        raise FormatError(f"{where}: source.model and recipe.name must be strings")
    for key in ("w_bits", "w_params", "model_bits", "model_bytes"):
        if not _is_number(m["effective_bits"].get(key)):
            raise FormatError(f"{where}: effective_bits.{key} must be a number, got {m['effective_bits'].get(key)!r}")


def _shard_path(p: Path, fname: str) -> Path:
    """The shard file, refused when it is a link leading out of the checkpoint directory: a checkpoint
    may not make moec read files elsewhere on the machine (a download into a hub cache links its files
    to blobs outside the snapshot: such a copy needs `--local-dir`)."""
    f = p / fname
    if f.is_symlink() and p.resolve() not in f.resolve().parents:
        raise FormatError(f"{f}: links to {os.readlink(f)}, outside the checkpoint directory (copy the file in)")
    return f


def verify(path: str | Path, manifest: dict | None = None) -> dict:
    """Check every shard's presence, size and sha256, and each tensor's shape and dtype."""
    p = Path(path)
    manifest = manifest or read_manifest(p)
    check_manifest(manifest, p / MANIFEST)
    check_index(p, manifest)
    for fname, meta in manifest["shards"].items():
        f = _shard_path(p, fname)
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
        with _open_shard(p, fname) as h:
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


def check_index(p: Path, manifest: dict) -> None:
    """The shard index, where there is one, maps exactly the manifest's tensors to their shards (FormatError):
    transformers reads the index, moec the manifest, and both must load the same checkpoint."""
    f = p / HF_INDEX
    if not f.is_file():
        return  # packed before the index was written: moec.hf.from_pretrained loads it without
    try:
        weight_map = json.loads(f.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError):
        weight_map = None
    if weight_map != {name: e["shard"] for name, e in manifest["tensors"].items()}:
        raise FormatError(f"{f}: its weight_map does not list the manifest's tensors and shards (a stale or "
                          f"edited index; delete it or re-pack)")


def _open_shard(p: Path, fname: str):
    """safe_open on a shard, a header the library refuses (offsets out of range or overlapping, an unknown
    dtype, a bad length) reported as FormatError."""
    try:
        return safe_open(_shard_path(p, fname), "pt")
    except SafetensorError as e:
        raise FormatError(f"{p / fname}: not a readable safetensors file ({e})") from None


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
        with _open_shard(p, fname) as h:
            for n in ns:
                out[n] = h.get_tensor(n)
    return out
