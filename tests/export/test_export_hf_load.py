"""compressed-tensors exports of a Mixtral-style MoE load in transformers: at fp32 the logits are moec's
(fp32 reference, dequantized weights) within 1e-4, at bf16 within bf16 rounding; and compressed-tensors matches
every quantized module, so it prints no "Could not match" line (it printed one per expert Linear before the
export targeted the class Linear, as llm-compressor writes a MoE: to_ct._targets)."""

from __future__ import annotations

import logging

import pytest
import torch

from moec.export import export
from moec.runtime.loader import load_model

from .packs import pack, rule


@pytest.mark.parametrize("rules", [
    [rule(["experts"], "intsym", 4, 32), rule(["attention"], "intsym", 8, 0)],
    [rule(["experts"], "fp8", 8)],
], ids=["intsym", "fp8"])
def test_ct_export_loads_in_transformers(tmp_path, caplog, rules):
    from transformers import AutoModelForCausalLM

    p = pack(tmp_path / "p", *rules)
    export(p, "ct", tmp_path / "c")
    model, _ = load_model(p)  # moec's runtime, fp32
    ids = torch.tensor([[1, 5, 30, 42, 7, 9, 11, 3]])
    with torch.no_grad():
        ref = model(ids)
    scale = ref.abs().max().item()
    fp8 = rules[0]["codec"] == "fp8"
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2 * scale)):
        with caplog.at_level(logging.WARNING):
            hf = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=dtype)
        assert "Could not match" not in caplog.text
        # transformers 5.17 keeps the tensors it renames (Mixtral's block_sparse_moe.* -> mlp.*) of a pre-quantized
        # checkpoint in their stored dtype (core_model_loading: `_dtype = None` for a renamed key), so the router
        # stays bf16 under dtype=float32: cast once after loading. It also dequantizes fp8 experts to bf16
        # (integrations/compressed_tensors.DecompressExperts), so fp8 is exact only to bf16 there.
        hf = hf.to(dtype)
        with torch.no_grad():
            out = hf(ids).logits.float()
        err = (out - ref).abs().max().item()
        assert err <= (3e-2 * scale if fp8 else tol), (dtype, err, scale)
