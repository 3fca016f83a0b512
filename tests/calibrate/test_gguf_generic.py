"""deepseek2 and gpt-oss GGUF files are read as the MoEs they are (issue 34): written in llama.cpp's layout
from tiny transformers models (tests/calibrate/gguf_files.py; experts in Q8_0 or MXFP4), read through
`resolve_model` into an HF directory whose transformers model gives the source model's logits with the
file's own (gguf-py-dequantized) tensors; MLA files (k_b / v_b split) and legacy ones (kv_b), softmax and
sigmoid routing, YaRN, sliding windows and sinks. What is not mapped exactly is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

from moec.calibrate.sources import resolve_model
from moec.errors import UserError
from tests.calibrate.gguf_files import Q8, tiny_model, write_deepseek2, write_gpt_oss

X = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(0))  # crosses the window of 8


def _read(path):
    out = resolve_model(str(path))
    return T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


YARN = {"factor": 4.0, "original": 128, "mscale_all_dim": 0.707}


@pytest.mark.parametrize("case", ["v3-mla-yarn", "v2-legacy", "gpt-oss-mxfp4", "gpt-oss-q8"])
def test_deepseek2_and_gpt_oss_gguf_read_exactly(tmp_path, monkeypatch, case):
    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{case}.gguf"
    if case == "v3-mla-yarn":
        rope = {"rope_type": "yarn", "factor": YARN["factor"], "original_max_position_embeddings": YARN["original"],
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": YARN["mscale_all_dim"],
                "mscale_all_dim": YARN["mscale_all_dim"], "rope_theta": 10000.0}
        model = tiny_model("deepseek_v3", rope_parameters=rope)
        write_deepseek2(path, model, mla=True, yarn=YARN)
    elif case == "v2-legacy":
        model = tiny_model("deepseek_v2")
        write_deepseek2(path, model, mla=False)
    else:
        model = tiny_model("gpt_oss")
        write_gpt_oss(path, model, **({"expert_qtype": Q8} if case == "gpt-oss-q8" else {}))
    back = _read(path)
    assert back.config.model_type == model.config.model_type
    with torch.no_grad():
        want, got = model(X).logits, back(X).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if case == "gpt-oss-mxfp4":  # the file really held fp4 experts: the read model is not the unquantized one
        assert back.config.layer_types == model.config.layer_types
        assert not torch.allclose(tiny_model("gpt_oss")(X).logits, got, atol=1e-3)


def test_unmapped_deepseek2_and_gpt_oss_files_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    oss = tiny_model("gpt_oss")
    # a tensor llama.cpp would use that moec does not map: a fused gate_up stack
    write_gpt_oss(tmp_path / "fused.gguf", oss, extra={"blk.0.ffn_gate_up_exps.weight": np.zeros((8, 256, 64))})
    with pytest.raises(UserError, match="tensor 'blk.0.ffn_gate_up_exps.weight' of GGUF architecture 'gpt-oss'"):
        resolve_model(str(tmp_path / "fused.gguf"))
    # a tensor the model needs and the file lacks: transformers' own report names it
    write_gpt_oss(tmp_path / "nosinks.gguf", oss, drop=("blk.1.attn_sinks.weight",))
    with pytest.raises(UserError, match=r"missing keys \(1, first model.layers.1.self_attn.sinks\)") as e:
        resolve_model(str(tmp_path / "nosinks.gguf"))
    assert "\n" not in str(e.value)
    # half of the split kv_b
    ds = tiny_model("deepseek_v3")
    write_deepseek2(tmp_path / "nokb.gguf", ds, drop=("blk.2.attn_v_b.weight",))
    with pytest.raises(UserError, match="blk.2 holds attn_k_b.weight without its pair"):
        resolve_model(str(tmp_path / "nokb.gguf"))
    assert not any((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-written was left behind


def test_gguf_tokenizer_read_or_left_out(tmp_path, monkeypatch, caplog):
    """A byte-level BPE vocabulary with a pre-tokenizer moec reproduces (here the demo-moe tokenizer, `gpt-2`)
    is converted and tokenizes as the model's own tokenizer; another pre-tokenizer leaves the model without a
    tokenizer and says so in one line, rather than one that splits text unlike llama.cpp."""
    from moec.calibrate import sources
    from moec.hf.tiny import DEMO_TOKENIZER

    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    write_gpt_oss(tmp_path / "tok.gguf", tiny_model("gpt_oss"), tokenizer=True)
    text = "In 1987, the S&P 500 fell 20.5% -- on one day!"
    want = T.AutoTokenizer.from_pretrained(DEMO_TOKENIZER)(text, add_special_tokens=False)["input_ids"]
    got = sources.load_tokenizer(resolve_model(str(tmp_path / "tok.gguf")))
    assert got(text, add_special_tokens=False)["input_ids"] == want
    monkeypatch.setattr(sources, "BYTE_BPE_PRE", ())
    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache2"))
    out = resolve_model(str(tmp_path / "tok.gguf"))
    assert not (out / "tokenizer.json").exists()
    assert "pre-tokenizer 'gpt-2') is not one moec converts exactly" in caplog.text
    with pytest.raises(UserError, match="no tokenizer files"):
        sources.load_tokenizer(out)


def test_gpt_oss_gguf_runs_in_the_engine(tmp_path, monkeypatch):
    """A gpt-oss GGUF with MXFP4 experts, read by moec, runs in moec's own engine (gpt_oss is an engine type now)
    with the logits transformers gives on the same directory."""
    from moec.runtime.hf_layout import HFCheckpoint
    from moec.runtime.model import build_model

    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "oss.gguf"
    write_gpt_oss(path, tiny_model("gpt_oss"))
    out = resolve_model(str(path))
    ck = HFCheckpoint(out)
    engine = build_model(ck.args, {k: v.float() for k, v in ck.state_dict().items()})
    with torch.no_grad():
        want = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(X).logits
        torch.testing.assert_close(engine(X), want, rtol=1e-5, atol=1e-4)
