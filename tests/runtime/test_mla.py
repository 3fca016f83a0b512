"""DeepSeek-V2/V3 in moec's engine: multi-head latent attention (absorbed decode over the latent cache),
group-limited routing, the correction bias, shared experts, YaRN.

The logits against transformers' own forward are tests/runtime/test_model_vs_hf.py (deepseek_v2, deepseek_v3
in tiny_hf.tiny_configs); here: the static engine (runtime/decode.py, CPU, no graphs) against the full causal
forward, a row-by-row prefill with rows of different lengths, the latent cache's bytes, the routing rules
against hand-worked cases, and the config round trip.
"""

import pytest
import torch

from moec.runtime.config import ModelArgs
from moec.runtime.decode import DecodeEngine
from moec.runtime.hf_layout import HFCheckpoint, args_from_config, config_from_args
from moec.runtime.kvcache import dense_cache
from moec.runtime.mla import MLACache
from moec.runtime.model import build_model, route
from tests.runtime.tiny_hf import make_tiny


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, path)
    ckpt = HFCheckpoint(path)
    return ckpt, build_model(ckpt.args, ckpt.state_dict())


def test_static_engine_matches_forward(tiny):
    """Two rows prefilled to different lengths, then decoded together: each step's logits equal the full causal
    forward's at that position (fp32 latent rows, so only summation order differs)."""
    ckpt, model = tiny
    a = ckpt.args
    T = 24
    tokens = torch.randint(0, a.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
    cache = dense_cache(a, 2, 32, dtype=torch.float32, mode="static")
    assert isinstance(cache, MLACache)
    eng = DecodeEngine(model, cache, graphs=False)
    lens = (9, 5)
    for r, n in enumerate(lens):
        got = eng.prefill(r, tokens[r, :n])
        torch.testing.assert_close(got, full[r, n - 1], atol=1e-4, rtol=1e-4)
    for s in range(T - max(lens)):
        eng.tokens[:2] = torch.stack([tokens[r, n + s] for r, n in enumerate(lens)])
        out = eng.step(2)
        for r, n in enumerate(lens):
            torch.testing.assert_close(out[r], full[r, n + s], atol=1e-4, rtol=1e-4)


def test_latent_cache_bytes(tiny):
    """The cache holds one row of kv_lora_rank + qk_rope_dim numbers per token and layer: 16 bits each in fp16,
    (r + rope) / (2·H·d) of what decompressed per-head keys and values would take."""
    ckpt, model = tiny
    a = ckpt.args
    cache = dense_cache(a, 1, 40)
    tokens = torch.randint(0, a.vocab_size, (1, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(tokens, cache, 0)
    assert cache.stored_bytes() == 17 * a.n_layers * (a.kv_lora_rank + a.qk_rope_dim) * 2
    assert cache.bits_per_element() == 16.0


def test_group_routing_rules():
    """Hand-worked cases: V2's group_max keeps the groups holding the best single scores, V3's group_top2 ranks
    groups by their two best biased scores, the bias picks experts but the weights are the unbiased scores,
    renormalized then scaled."""
    base = dict(arch="deepseek_v3", vocab_size=8, dim=4, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=4,
                n_experts=8, top_k=2, expert_dim=4, n_group=4, topk_group=1)
    x = torch.eye(4)[:1]  # router logits = the router's first column
    logit = torch.tensor([0.0, 0.0, 3.0, -5.0, 2.0, 2.0, -1.0, 0.5])
    router = torch.zeros(8, 4)
    router[:, 0] = logit
    # group_top2 of sigmoid scores: groups (0,1) 0.5+0.5, (2,3) 0.95+0.007, (4,5) 0.88+0.88, (6,7) 0.27+0.62
    a = ModelArgs(**base, router_score="sigmoid", topk_method="group_top2", routed_scale=2.0)
    _, w, ids = route(x, router, 2, True, a)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(w[0], torch.full((2,), 1.0))  # equal scores renormalized to 1/2, times 2
    # group_max (softmax scores): the single best expert (2) decides, its group's other expert (3) is next
    a = ModelArgs(**base, router_score="softmax", topk_method="group_max", norm_topk=False)
    _, w, ids = route(x, router, 2, False, a)
    assert sorted(ids[0].tolist()) == [2, 3]
    p = torch.softmax(logit, 0)
    torch.testing.assert_close(w[0].sort().values, p[[3, 2]])
    # the correction bias moves the choice (expert 7 over 4/5), not the weight
    a = ModelArgs(**base | dict(topk_group=4), router_score="sigmoid", topk_method="group_top2", norm_topk=False)
    bias = torch.zeros(8)
    bias[7] = 1.0
    _, w, ids = route(x, router, 2, False, a, bias)
    assert 7 in ids[0].tolist()
    torch.testing.assert_close(w[0][ids[0] == 7], torch.sigmoid(logit[7:8]))


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_config_round_trip(arch, tmp_path):
    """config_from_args inverts args_from_config (what a packed checkpoint's config.json carries), YaRN included."""
    make_tiny(arch, tmp_path)
    args = HFCheckpoint(tmp_path).args
    again = args_from_config(config_from_args(args))
    assert again == args


def test_mla_refusals():
    """A DeepSeek config whose KV heads differ from its heads, or with a routing rule moec does not compute, is
    refused in one line."""
    from moec.errors import UserError

    cfg = dict(model_type="deepseek_v2", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    with pytest.raises(UserError, match="num_key_value_heads 1 != num_attention_heads 2"):
        args_from_config(cfg)
    cfg |= dict(num_key_value_heads=2, topk_method="random")
    with pytest.raises(UserError, match="topk_method 'random' is not supported"):
        args_from_config(cfg)


def test_static_step_kernel_matches_torch_path(monkeypatch):
    """MLACache's static step through kernels/mla_decode_attention.py (MOEC_KERNELS=1; the interpreter on the CPU)
    equals its torch path step by step, outputs and the rows the kernel writes."""
    import moec.kernels.mla_decode_attention as mk

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=48,
                  max_seq_len=64, attn_kind="mla", kv_lora_rank=32, qk_rope_dim=16, v_head_dim=32)
    calls = []
    real = mk.mla_decode_attention
    monkeypatch.setattr(mk, "mla_decode_attention", lambda *x, **kw: calls.append(1) or real(*x, **kw))
    caches = {m: MLACache(a, 2, 64, device=dev, mode="static") for m in ("0", "1")}
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(1, 10, a.latent_dim, generator=g)
    for c in caches.values():
        c.prefill_row(0, 0, pre.half().to(dev))
        c.prefill_row(1, 0, pre[:, :3].half().to(dev))
    for step in range(4):
        q = torch.randn(2, 4, 1, a.latent_dim, generator=g).to(dev)
        kv = torch.randn(2, 1, 1, a.latent_dim, generator=g).to(dev)
        outs = {}
        for m, c in caches.items():
            monkeypatch.setenv("MOEC_KERNELS", m)
            c.pos = torch.tensor([10 + step, 3 + step], device=dev)
            outs[m] = c.attend(0, q, kv)
        torch.testing.assert_close(outs["1"], outs["0"], atol=2e-3, rtol=2e-3)
    assert torch.equal(caches["0"].rows[0], caches["1"].rows[0])
    assert len(calls) == 4  # the kernel ran on every MOEC_KERNELS=1 step, and only there


def test_builtin_demo_mla_matches_transformers():
    """The shipped demo-mla (trained weights, bf16 on disk) through moec's engine in fp32 equals transformers' own
    DeepseekV3ForCausalLM on the same text, and its absorbed decode equals its prefill."""
    import transformers as T

    from moec.calibrate.sources import resolve_model

    d = resolve_model("demo-mla")
    ckpt = HFCheckpoint(d)
    assert ckpt.args.is_mla and ckpt.args.router_bias and ckpt.args.shared_dim
    model = build_model(ckpt.args, {k: v.float() for k, v in ckpt.state_dict().items()})
    ref = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.randint(0, ckpt.args.vocab_size, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = ref(tokens).logits, model(tokens)
        cache = dense_cache(ckpt.args, 1, 48, dtype=torch.float32)
        steps = [model(tokens[:, :8], cache, 0)] + [model(tokens[:, t : t + 1], cache, t) for t in range(8, 48)]
        dec = torch.cat(steps, dim=1)
    assert (got - want).abs().max().item() < 1e-3
    assert (dec - got).abs().max().item() < 1e-3
