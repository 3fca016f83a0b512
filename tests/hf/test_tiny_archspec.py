"""Tiny random configs of every MoE type moec tests (moec/hf/tiny.py) and the ArchSpec read from their
modules (moec/hf/archspec.py).

Every type builds within the tiny bounds, runs a forward and generates; its ArchSpec's per-layer facts are
checked for a handful of types against what their transformers 5.17 modeling code does (cited per test);
param_groups puts every parameter in exactly one group and every experts parameter in "experts". Each model
is built once (`_model`, cached for the module): the whole file is about ten seconds on a busy CPU.
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moec.errors import UserError
from moec.hf import tiny
from moec.hf.archspec import GROUPS, arch_spec, arch_spec_from_config, param_groups

IDS = torch.randint(1, tiny.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


@functools.cache
def _model(model_type: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny.tiny_model(model_type)
    return model, arch_spec(model)


def test_enough_types():
    # the target: ≥ 25 text-only causal-LM MoE types pass the later chain; the table carries margin
    text_only = [t for t in tiny.TINY_TYPES if t not in tiny.MULTIMODAL_FAMILY]
    assert len(text_only) >= 30, text_only
    required = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
                "qwen3_next", "minimax_m2", "granitemoe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "phimoe",
                "flex_olmo", "llama4_text"}
    assert required <= set(tiny.TINY_TYPES)


@pytest.mark.parametrize("model_type", tiny.TINY_TYPES)
def test_tiny_type_builds_runs_and_generates(model_type):
    model, spec = _model(model_type)
    cfg = model.config.get_text_config()
    assert cfg.model_type == model_type and cfg.vocab_size == tiny.VOCAB
    assert len(spec.layers) <= 4 and cfg.hidden_size <= 64
    moe = [layer for layer in spec.layers if layer.ffn == "moe"]
    assert moe and all(layer.experts.n_experts <= 8 for layer in moe), spec
    assert all(layer.router is not None and 1 <= layer.router.top_k <= layer.experts.n_experts for layer in moe)
    # no constant tensor left: norms, zero biases, sinks and score-correction biases were made random
    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.numel() > 1:
            assert not bool((t == t.reshape(-1)[0]).all()), f"{model_type}: {name} is constant"
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.shape == (2, 8, tiny.VOCAB) and torch.isfinite(logits).all()
    out = model.generate(IDS[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tiny.EOS)
    assert out.shape == (1, 12)


@pytest.mark.parametrize("model_type", tiny.TINY_TYPES)
def test_param_groups_cover_every_parameter_once(model_type):
    model, spec = _model(model_type)
    groups = param_groups(model, spec)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(groups) == sorted(names) and len(set(names)) == len(names)
    assert set(groups.values()) <= set(GROUPS)
    prefix = spec.layers_path
    for layer in spec.layers:
        if layer.experts is None:
            continue
        mod = model.get_submodule(f"{prefix}.{layer.index}.{layer.experts.module}")
        own = [f"{prefix}.{layer.index}.{layer.experts.module}.{n}" for n, _ in mod.named_parameters()]
        assert own and all(groups[n] == "experts" for n in own), model_type
    assert sum(g == "experts" for g in groups.values()) == sum(
        len(list(model.get_submodule(f"{prefix}.{layer.index}.{layer.experts.module}").parameters()))
        for layer in spec.layers if layer.experts)
    assert "router" in groups.values() and ("attention" in groups.values()) == any(
        layer.attention not in ("linear", "none") for layer in spec.layers)
    # every weight a recipe can target reads a multiple of 32 inputs (groups of 32, per-row codebooks)
    params = dict(model.named_parameters())
    for name, group in groups.items():
        p = params[name]
        if group != "other" and p.dim() >= 2 and not name.endswith("_bias"):
            transposed = group == "experts" and \
                spec.layers[int(name[len(prefix) + 1:].split(".")[0])].experts.is_transposed
            assert (p.shape[-2] if transposed else p.shape[-1]) % 32 == 0, (name, tuple(p.shape))


def test_deepseek_v3():
    # modeling_deepseek_v3: DeepseekV3MLP below first_k_dense_replace; DeepseekV3TopkRouter: sigmoid scores,
    # e_score_correction_bias, n_group / topk_group, norm_topk_prob, routed_scaling_factor; MLA attention
    # (kv_a_proj_with_mqa); DeepseekV3MoE.shared_experts
    spec = arch_spec_from_config(tiny.tiny_config("deepseek_v3"))
    assert spec == _model("deepseek_v3")[1]  # the meta-device build reads the same spec as the CPU model
    dense, moe = spec.layers[0], spec.layers[1]
    assert (dense.ffn, dense.experts, dense.router, dense.mlp_module) == ("dense", None, None, "mlp")
    assert all(layer.attention == "mla" for layer in spec.layers)
    r = moe.router
    assert (moe.ffn, r.score, r.bias, r.n_group, r.topk_group, r.top_k, r.renormalize) == \
        ("moe", "sigmoid", True, 4, 2, 2, True)
    assert r.scaling == pytest.approx(2.5) and r.module == "mlp.gate" and r.probed
    assert moe.shared_experts == 1 and moe.shared_modules == ("mlp.shared_experts",)
    e = moe.experts
    assert (e.module, e.gate_up, e.is_transposed, e.has_bias, e.decorated, e.n_experts, e.intermediate) == \
        ("mlp.experts", "gate_up_proj", False, False, True, 8, 64)
    msg = spec.kv_refusal()
    assert msg.startswith("deepseek_v3 layer 0 (self_attn): mla attention") and "\n" not in msg
    assert spec.engine and spec.layers_path == "model.layers"  # moec's engine runs it (runtime/model.MLAttention)


def test_gpt_oss():
    # modeling_gpt_oss: GptOssExperts decorated is_transposed=True, has_bias=True; GptOssAttention.sinks;
    # layer_types alternate sliding / full; GptOssTopKRouter: top-k logits, then softmax over them
    spec = _model("gpt_oss")[1]
    assert [(layer.attention, layer.window, layer.sinks) for layer in spec.layers] == \
        [("sliding", tiny.WINDOW, True), ("full", None, True)] * 2
    e = spec.layers[0].experts
    assert (e.is_transposed, e.has_bias, e.has_gate, e.decorated, e.intermediate) == (True, True, True, True, 128)
    assert e.custom_gate and not _model("mixtral")[1].layers[0].experts.custom_gate  # GptOssExperts._apply_gate
    r = spec.layers[0].router
    assert (r.score, r.renormalize, r.bias, r.n_group, r.scaling) == ("softmax", True, False, None, None)
    assert "sliding attention" in spec.kv_refusal()


def test_qwen3_next():
    # modeling_qwen3_next: Qwen3NextGatedDeltaNet on linear_attention layers, Qwen3NextAttention elsewhere;
    # Qwen3NextSparseMoeBlock.shared_expert (its shared_expert_gate is a [1, hidden] gate, not an MLP)
    model, spec = _model("qwen3_next")
    assert [(layer.attention, layer.attention_module) for layer in spec.layers] == \
        [("linear", "linear_attn"), ("full", "self_attn")] * 2
    assert all(layer.shared_modules == ("mlp.shared_expert",) for layer in spec.layers)
    groups = param_groups(model, spec)
    assert groups["model.layers.0.linear_attn.in_proj_qkvz.weight"] == "other"
    assert groups["model.layers.1.self_attn.q_proj.weight"] == "attention"
    assert groups["model.layers.0.mlp.shared_expert_gate.weight"] == "other"
    assert groups["model.layers.0.mlp.shared_expert.down_proj.weight"] == "shared_experts"
    assert spec.kv_refusal().startswith("qwen3_next layer 0 (linear_attn): linear attention")


def test_mixtral():
    # modeling_mixtral: MixtralTopKRouter softmax → top-k → renormalised; no bias, groups, scaling or sinks
    model, spec = _model("mixtral")
    assert spec.engine and spec.kv_refusal() is None
    for layer in spec.layers:
        assert (layer.attention, layer.window, layer.sinks, layer.ffn, layer.shared_experts) == \
            ("full", None, False, "moe", 0)
        r = layer.router
        assert (r.score, r.top_k, r.bias, r.n_group, r.scaling, r.renormalize) == \
            ("softmax", 2, False, None, None, True)
    groups = param_groups(model, spec)
    assert groups["lm_head.weight"] == "lm_head" and groups["model.embed_tokens.weight"] == "other"
    assert groups["model.layers.0.mlp.gate.weight"] == "router"
    assert groups["model.layers.0.self_attn.o_proj.weight"] == "attention"
    assert groups["model.layers.0.input_layernorm.weight"] == "other"


def test_llama4_undecorated_experts():
    # modeling_llama4: Llama4TextExperts is a plain module, gate_up_proj [E, hidden, 2I]; MoE on moe_layers,
    # Llama4TextMLP elsewhere; Llama4Router: sigmoid of the top-k logits; chunked attention per layer_types
    model, spec = _model("llama4_text")
    assert [layer.ffn for layer in spec.layers] == ["dense", "moe", "dense", "moe"]
    e = spec.layers[1].experts
    assert (e.decorated, e.is_transposed, e.has_gate, e.n_experts, e.intermediate) == (False, True, True, 8, 128)
    assert spec.layers[1].router.score == "sigmoid" and spec.layers[1].shared_modules == ("feed_forward.shared_expert",)
    assert [layer.attention for layer in spec.layers] == ["chunked", "chunked", "chunked", "full"]
    assert param_groups(model, spec)["model.layers.1.feed_forward.experts.gate_up_proj"] == "experts"


def test_real_size_configs_on_meta():
    # the default configs (real sizes: 128 / 512 experts, hidden 2880 / 2048) built on the meta device; the
    # router probe must still tell renormalised top-k weights from raw ones (gpt_oss: softmax over the top-k
    # logits; qwen3_next: norm_topk_prob=True; qwen3_moe: False)
    from transformers import GptOssConfig, Qwen3MoeConfig, Qwen3NextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt, qn, q3 = (arch_spec_from_config(c()) for c in (GptOssConfig, Qwen3NextConfig, Qwen3MoeConfig))
    assert [(layer.attention, layer.window) for layer in gpt.layers[:2]] == [("sliding", 128), ("full", None)]
    assert (gpt.layers[0].router.top_k, gpt.layers[0].router.renormalize, gpt.layers[0].experts.n_experts) == \
        (4, True, 128)
    assert (qn.layers[0].attention, qn.layers[3].attention) == ("linear", "full")
    assert (qn.layers[0].router.top_k, qn.layers[0].router.renormalize, qn.layers[0].experts.n_experts) == \
        (10, True, 512)
    assert (q3.layers[0].router.renormalize, q3.engine, len(q3.layers)) == (False, True, 24)


def test_unknown_type_is_one_line():
    with pytest.raises(UserError) as e:
        tiny.tiny_config("not_a_model")
    assert "not_a_model" in str(e.value) and "TINY_TYPES" in str(e.value) and "\n" not in str(e.value)


def test_save_tiny_is_an_hf_directory(tmp_path):
    out = tiny.save_tiny("qwen3_moe", tmp_path / "qm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["bos_token_id"] == cfg["eos_token_id"] == tiny.BOS
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == tiny.EOS and len(tok) == tiny.VOCAB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, _model("qwen3_moe")[0](IDS).logits)
    assert not [p for p in tmp_path.iterdir() if p.name != "qm" and not p.name.endswith(".lock")]
