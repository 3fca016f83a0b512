"""The manifest's `kv` section: schema, tensor names, and reading older format versions.

Format 2 (this version): the section is the recipe's KV config for its codec, as a dict
(`dataclasses.asdict` of the codec's config class, moec/codecs/<family>.py), plus
    n_layers, n_kv_heads, head_dim   the model shapes the calibration was fitted for
    tensors                          the `kv.*` tensors stored (manifest `tensors` entries, codec kv-calib)
and the derived keys a codec adds (latent: n_groups). The keys a codec reads are its config's: no
key is shared by accident (format 1 wrote every key of one flat class, and latent-* overwrote
`outlier_frac` with its own).

Calibration tensor names: per layer `kv.layers.{i}.{part}` (nuq-outlier, rvq-tiered), per layer group
`kv.groups.{g}.{part}` (latent-*).

Format 1 sections are read by `upgrade`: the latent keys move under `latent`; the other keys of the
flat format-1 class stay (a codec reads only the keys its config declares).
"""

from __future__ import annotations

from ..errors import FormatError

COMMON = ("codec", "bits", "n_layers", "n_kv_heads", "head_dim")
LATENT_V1_KEYS = ("rank_k", "rank_v", "energy", "group_layers", "outlier_frac")


def layer_tensor(layer: int, part: str) -> str:
    return f"kv.layers.{layer}.{part}"


def group_tensor(group: int, part: str) -> str:
    return f"kv.groups.{group}.{part}"


def check(section: dict, where: str = "kv") -> dict:
    """The common keys are there with the right types (FormatError naming the key otherwise)."""
    if not isinstance(section, dict):
        raise FormatError(f"manifest {where}: expected a mapping, got {type(section).__name__}")
    for key in COMMON:
        if key not in section:
            raise FormatError(f"manifest {where}: missing {key!r}")
        want = str if key == "codec" else int
        if not isinstance(section[key], want) or isinstance(section[key], bool):
            raise FormatError(f"manifest {where}.{key}: expected {want.__name__}, got {section[key]!r}")
    names = section.get("tensors", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FormatError(f"manifest {where}.tensors: expected a list of tensor names, got {names!r}")
    return section


def upgrade(section: dict | None, version: int) -> dict | None:
    """A `kv` section of format `version` as format 2 reads it."""
    if section is None or version >= 2:
        return section
    s = dict(section)
    if s.get("codec", "").startswith("latent-"):
        s["latent"] = {k: s.pop(k) for k in LATENT_V1_KEYS if k in s}
    return s
