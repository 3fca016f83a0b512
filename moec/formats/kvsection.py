"""The manifest's `kv` section: schema, tensor names, and reading older format versions.

Format 3 (this version): every recipe key has one home, the manifest's resolved `recipe` (its `kv:`
mapping holds codec, bits, window, sinks and every other key of the codec's config class,
moec/codecs/<family>.py). The `kv` section holds only what is not a recipe key:
    n_layers, n_kv_heads, head_dim   the model shapes the calibration was fitted for
    tensors                          the `kv.*` tensors stored (manifest `tensors` entries, codec kv-calib)
and the keys a codec derives from its config and the model (latent: n_groups). A key in both is
refused (`check`). The runtime joins the two in one place (moec/runtime/loader.py `kv_section`), where
the codec's typed config is built from `recipe.kv`.

Calibration tensor names: per layer `kv.layers.{i}.{part}` (nuq-outlier, rvq-tiered), per layer group
`kv.groups.{g}.{part}` (latent-*).

Older versions are read by `upgrade`: format 2 wrote the section as the codec's config plus the shapes
(so each recipe key was stored in both `kv` and `recipe.kv`): the section's values of the keys
`recipe.kv` has move there (the section is what a format-2 reader read), and the rest stays. Format 1
wrote one flat class for every codec: its latent keys move under `latent` first.
"""

from __future__ import annotations

from ..errors import FormatError

SHAPES = ("n_layers", "n_kv_heads", "head_dim")
RECIPE_COMMON = ("codec", "bits")  # the keys every KV codec's config has (codecs/base.py)
LATENT_V1_KEYS = ("rank_k", "rank_v", "energy", "group_layers", "outlier_frac")


def layer_tensor(layer: int, part: str) -> str:
    return f"kv.layers.{layer}.{part}"


def group_tensor(group: int, part: str) -> str:
    return f"kv.groups.{group}.{part}"


def _typed(mapping: dict, key: str, want: type, where: str) -> None:
    if key not in mapping:
        raise FormatError(f"manifest {where}: missing {key!r}")
    if not isinstance(mapping[key], want) or isinstance(mapping[key], bool):
        raise FormatError(f"manifest {where}.{key}: expected {want.__name__}, got {mapping[key]!r}")


def check(section: dict, recipe_kv, where: str = "kv") -> dict:
    """A format-3 section and its recipe's `kv:` have the keys the runtime reads first, with their types,
    and share none (FormatError naming the key otherwise)."""
    if not isinstance(section, dict):
        raise FormatError(f"manifest {where}: expected a mapping, got {type(section).__name__}")
    if not isinstance(recipe_kv, dict):
        raise FormatError(f"manifest recipe.kv: expected the KV codec's mapping (the `{where}` section needs it), "
                          f"got {recipe_kv!r}")
    for key in RECIPE_COMMON:
        _typed(recipe_kv, key, str if key == "codec" else int, "recipe.kv")
    for key in SHAPES:
        _typed(section, key, int, where)
    names = section.get("tensors", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FormatError(f"manifest {where}.tensors: expected a list of tensor names, got {names!r}")
    twice = sorted(section.keys() & recipe_kv.keys())
    if twice:
        raise FormatError(f"manifest {where}.{twice[0]}: stored twice (also in recipe.kv, its one home)")
    return section


def upgrade(manifest: dict, version: int) -> dict:
    """`manifest` (a dict, changed in place and returned) of format `version` as format 3 reads it."""
    section, recipe = manifest.get("kv"), manifest.get("recipe")
    if section is None or version >= 3 or not isinstance(section, dict) or not isinstance(recipe, dict):
        return manifest  # check() names a section or a recipe that is not a mapping
    s = dict(section)
    if version < 2 and str(s.get("codec", "")).startswith("latent-"):
        s["latent"] = {k: s.pop(k) for k in LATENT_V1_KEYS if k in s}
    recipe_kv = dict(recipe.get("kv") or {})
    for key in [k for k in s if k in recipe_kv or k in RECIPE_COMMON]:
        recipe_kv[key] = s.pop(key)
    manifest["recipe"] = {**recipe, "kv": recipe_kv}
    manifest["kv"] = s
    return manifest
