"""The shipped recipes: the YAML files of moec/recipes/ (package data, so an installed wheel has them), found by
name (`--recipe experts-hls3`), listed by `moec recipes`, and the `--scheme` shorthands for common formats.

A `--recipe` value is a path when a file of that name exists, else the name of a shipped recipe (the file name
without `.yaml`; those of ablations/ too: names are unique over the two folders, tests/calibrate/test_catalog.py).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import UserError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # moec/recipes/, installed as package data


@dataclass(frozen=True)
class Scheme:
    recipe: str  # the shipped recipe it stands for
    about: str


# `--scheme NAME` (case-insensitive) -> the shipped recipe it stands for. The names are the ones other tools use
# for the format (llm-compressor's preset schemes W4A16, W8A16, FP8, NVFP4, MXFP4) and moec's own expert recipes.
# moec quantizes weights only: activations stay in the compute dtype in every scheme (FP8 is llm-compressor's
# FP8 weights, not its W8A8 activations).
SCHEMES: dict[str, Scheme] = {
    "W4A16": Scheme("w4a16", "int4 symmetric weights, groups of 128, GPTQ (llm-compressor's W4A16)"),
    "W8A16": Scheme("w8a16", "int8 symmetric weights, GPTQ (llm-compressor's W8A16)"),
    "FP8": Scheme("experts-fp8", "FP8 e4m3 expert/MLP weights, one scale per output row"),
    "NVFP4": Scheme("experts-nvfp4", "FP4 e2m1 expert/MLP weights, fp8 scale per 16 + fp32 global scale"),
    "MXFP4": Scheme("experts-mxfp4", "FP4 e2m1 expert/MLP weights, e8m0 scale per 32 (as gpt-oss ships)"),
    "moec-e2": Scheme("experts-hls2-had", "moec's 2-bit experts: Hessian-weighted codebooks, GPTQ, Hadamard"),
    "moec-e3": Scheme("experts-hls3-had", "moec's 3-bit experts: Hessian-weighted codebooks, GPTQ, Hadamard"),
}


def recipe_files(directory: str | Path = RECIPES_DIR) -> list[Path]:
    """The recipe files of a recipes directory and of its ablations/ folder, in name order."""
    d = Path(directory)
    return sorted([*d.glob("*.yaml"), *d.glob("ablations/*.yaml")], key=lambda p: p.stem)


def shipped() -> dict[str, Path]:
    """{name: file} of every shipped recipe."""
    return {p.stem: p for p in recipe_files(RECIPES_DIR)}


def is_ablation(path: Path) -> bool:
    return path.parent.name == "ablations"


def purpose(path: Path) -> str:
    """A recipe's purpose in one line: its `description:`, else the first sentence of its leading comment."""
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict) and data.get("description"):
        return " ".join(str(data["description"]).split())
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    comment = " ".join(lines)
    m = re.match(r"(.+?[.:;])(\s|$)", comment)
    return (m.group(1) if m else comment) or "-"


def find_recipe(spec: str | Path) -> Path:
    """The file a `--recipe` value names: an existing path as given, else a shipped recipe by name. UserError
    (one line, how to see the names) for anything else."""
    p = Path(spec)
    if p.is_file():
        return p
    text = str(spec)
    if "/" in text or "\\" in text or p.suffix in (".yaml", ".yml"):
        raise UserError(f"recipe {text}: no such file (or give a shipped recipe by name: `moec recipes` lists them)")
    names = shipped()
    if text in names:
        return names[text]
    close = difflib.get_close_matches(text, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UserError(f"recipe {text!r}: no such file or shipped recipe ({hint}`moec recipes` lists the shipped ones)")


def scheme_recipe(name: str) -> str:
    """The shipped recipe name that `--scheme NAME` stands for; UserError (one line) for an unknown scheme or one
    whose recipe this moec does not ship."""
    by_key = {k.casefold(): k for k in SCHEMES}
    key = by_key.get(name.casefold())
    if key is None:
        raise UserError(f"--scheme {name}: unknown; schemes: {', '.join(SCHEMES)} (`moec recipes` shows each one's "
                        "recipe)")
    recipe = SCHEMES[key].recipe
    if recipe not in shipped():
        raise UserError(f"--scheme {key}: its recipe {recipe} is not shipped with this moec (`moec recipes` lists "
                        "what is)")
    return recipe


def recipe_arg(recipe: str | None, scheme: str | None, required: bool = True) -> str | None:
    """The recipe of a command given `--recipe` or `--scheme` (one of them; None when neither and not required)."""
    if recipe is not None and scheme is not None:
        raise UserError(f"--recipe {recipe} and --scheme {scheme} both choose the recipe; pass one")
    if scheme is not None:
        return scheme_recipe(scheme)
    if recipe is None and required:
        raise UserError("give --recipe NAME|FILE or --scheme NAME (`moec recipes` lists both)")
    return recipe
