"""Which MoE types of transformers the transformers path runs: the per-type checks behind
`tests/hf/test_types.py` (in process, every type of `moec.hf.tiny`) and `benchmarks/bench_coverage.py`
(the same, plus the whole CLI chain per type, written to benchmarks/results/coverage.json).

In process (`check_in_process`), on a tiny random model saved as transformers saves it:
  identity  the fp16 identity pack through `moec.hf.from_pretrained`: logits against the source's (relative L2,
            fp32; bound IDENTITY_BOUND)
  quant     a calibrated pack (experts and every linear rtn 4-bit per row; 1 × 16 tokens) against the source with
            its quantized matrices dequantized (`generic.dequantized_reference`; bound QUANT_BOUND)
  auto      the same pack through `AutoModelForCausalLM.from_pretrained` after `import moec.hf` (QUANT_BOUND)

Through the CLI (`check_cli`): `moec calibrate` with `chain_recipe` (experts: 2-bit hls with GPTQ as
experts-hls2; attention, dense and shared MLPs: int4 symmetric groups of 32 with GPTQ as w4a16-g32; the
default KV recipe's codec where the type's attention allows it, with a window short enough that the evaluation
window's history goes through the codec) → `moec pack` → `moec eval` (tf and dec, KL to the source) →
`moec generate` (16 greedy tokens, which must equal the dequantized reference's, with the pack's KV cache where
the recipe has one).
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

IDENTITY_BOUND, QUANT_BOUND = 1e-5, 1e-4
TYPES_RECIPE = {"name": "types-rtn4", "weights": [
    {"targets": ["experts", "attention", "mlp", "shared_experts"], "codec": "rtn", "bits": 4, "group_size": 0}]}
PROMPT, NEW_TOKENS = "the company said that", 16
# the default KV recipe's codec, its window and sinks shortened so a 64-token evaluation window sends most of
# its history through the codec (with the shipped 512-token window nothing would leave fp16 here)
KV_RECIPE, KV_SHORT = "kv-nuq2-rot-w512", {"window": 16, "sinks": 2, "block": 16}


def _printable(text: str) -> str:
    """Text as `moec generate` prints it: control characters and a trailing partial UTF-8 character (a
    replacement character) left out, outer whitespace stripped."""
    return "".join(c for c in text.rstrip("\ufffd") if c in "\n\t" or unicodedata.category(c) != "Cc").strip()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def check_in_process(model_type: str, tmp: Path) -> dict:
    """{identity, quant, auto: relative L2 errors, quantized_params, transposed, ok} for `model_type`."""
    import transformers as T

    from ..calibrate.generic_capture import calibrate_generic
    from ..calibrate.generic_pack import pack_any, pack_generic
    from ..calibrate.recipe import load_recipe, parse_recipe
    from ..formats import checkpoint
    from ..registry import stored_as_is
    from . import from_pretrained
    from .generic import dequantized_reference
    from .tiny import save_tiny

    save_tiny(model_type, tmp / "src")
    model = T.AutoModelForCausalLM.from_pretrained(tmp / "src", dtype=torch.float32).eval()
    x = torch.randint(0, model.config.get_text_config().vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    r = {}
    pack_generic(tmp / "src", model_type, load_recipe("fp16"), tmp / "fp16")
    r["identity"] = rel(from_pretrained(tmp / "fp16")(x).logits, model(x).logits)
    calibrate_generic(tmp / "src", model_type, parse_recipe(TYPES_RECIPE), "ptb", "train", 1, 16, 0, tmp / "calib",
                      batch_size=1)
    pack_any(tmp / "src", model_type, tmp / "calib", tmp / "q")
    packed = from_pretrained(tmp / "q")
    manifest = checkpoint.verify(tmp / "q")
    want = dequantized_reference(model, packed, manifest)(x).logits
    r["quant"] = rel(packed(x).logits, want)
    r["auto"] = rel(T.AutoModelForCausalLM.from_pretrained(tmp / "q", dtype=torch.float32)(x).logits, want)
    r["quantized_params"] = len({e["param"] for e in manifest["tensors"].values() if not stored_as_is(e["codec"])})
    r["transposed"] = len(manifest["hf"]["transposed"])
    r["ok"] = r["identity"] <= IDENTITY_BOUND and r["quant"] <= QUANT_BOUND and r["auto"] <= QUANT_BOUND
    return r


def chain_recipe(model_type: str) -> tuple[dict, str | None]:
    """(the CLI chain's recipe for `model_type`, why the KV codec is left out or None)."""
    from ..calibrate.catalog import find_recipe
    from .archspec import arch_spec_from_config
    from .tiny import tiny_config

    experts = yaml.safe_load(find_recipe("experts-hls2").read_text())["weights"][0]
    linear = yaml.safe_load(find_recipe("w4a16-g32").read_text())["weights"][0]
    recipe = {"name": f"coverage-{model_type}",
              "weights": [{**experts, "targets": ["experts"]},
                          {**linear, "targets": ["attention", "mlp", "shared_experts"]}],
              "calibration": {"seed": 0, "min_expert_tokens": 0}}
    why = arch_spec_from_config(tiny_config(model_type)).kv_refusal()
    if why is None:
        recipe["kv"] = {**yaml.safe_load(find_recipe(KV_RECIPE).read_text())["kv"], **KV_SHORT}
    return recipe, why


def check_cli(model_type: str, tmp: Path, moec: Callable) -> dict:
    """The CLI chain on `model_type` (moec(*args) -> CompletedProcess: `moec.cli.app.run` or a subprocess):
    {steps: {step: seconds}, failed: the step that failed and its last stderr line, kv, ppl, kld, w_bits, ...}."""
    import json

    import transformers as T

    from ..calibrate.sources import load_tokenizer
    from ..formats import checkpoint
    from . import MoecCache, from_pretrained
    from .generic import dequantized_reference
    from .load import use_moec_attention
    from .tiny import save_tiny

    rec: dict = {"steps": {}}
    recipe, why = chain_recipe(model_type)
    rec["kv"] = recipe["kv"]["codec"] if "kv" in recipe else f"refused: {why}"
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    save_tiny(model_type, tmp / "src")
    steps = {
        "calibrate": ("calibrate", tmp / "src", "--recipe", tmp / "r.yaml", "--samples", "4", "--seq-len", "64",
                      "-o", tmp / "calib", "--path", "transformers"),  # the engine's types too: this path is tested
        "pack": ("pack", tmp / "src", tmp / "calib", "-o", tmp / "packed"),
        "eval": ("eval", tmp / "packed", "--baseline", tmp / "src", "--seq-len", "64", "--max-windows", "2",
                 "--json", tmp / "eval.json"),
        "generate": ("generate", tmp / "packed", "-p", PROMPT, "-n", str(NEW_TOKENS), "--no-stop-at-eos"),
    }
    out = None
    for step, args in steps.items():
        t0 = time.time()
        r = moec(*args)
        rec["steps"][step] = round(time.time() - t0, 2)
        if r.returncode != 0:
            rec["failed"] = f"{step}: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1][:300]}"
            return rec
        out = r.stdout
    evals = json.loads((tmp / "eval.json").read_text())
    rec.update({f"{e['mode']}_{k}": e.get(k) for e in evals for k in ("ppl", "base_ppl", "kld")})
    manifest = checkpoint.verify(tmp / "packed")
    rec["w_bits"] = manifest["effective_bits"]["w_bits"]
    # the reference: the source with the pack's quantized matrices dequantized, run by transformers, with the
    # pack's KV cache (and moec's attention, which applies its history score bias) where the recipe has one
    source = T.AutoModelForCausalLM.from_pretrained(tmp / "src", dtype=torch.float32).eval()
    ref = dequantized_reference(source, from_pretrained(tmp / "packed"), manifest)
    kw = {}
    if manifest.get("kv"):
        use_moec_attention(ref)
        kw["past_key_values"] = MoecCache.from_packed(tmp / "packed")
    tok = load_tokenizer(tmp / "src")
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, **kw)[0, ids.shape[1]:]
    rec["generate_equal"] = _printable(out) == _printable(PROMPT + tok.decode(want.tolist(), skip_special_tokens=True))
    if not rec["generate_equal"]:
        rec["failed"] = "generate: the greedy tokens differ from the dequantized reference's"
    return rec
