"""The static decode engine (moec/runtime/decode.py) against the reference decode path.

On demo-moe (real trained weights, real PTB text), ppl_dec through the static engine must equal
moec/runtime/perplexity.py's `evaluate(..., "dec")` with the matching dynamic cache within 0.1%
relative (issue 5). Both round K/V to fp16 and encode the same blocks with the same codec; what
differs is summation order (masked SDPA over static buffers vs concatenated tensors) and the prefill
attention (fp32 K/V in the engine's causal forward vs the cache's fp16 copies), ~1e-5 relative.
A wrong position, slot or block boundary moves ppl by percents.
"""

import pytest
import torch

from moec.rotation import block_hadamard
from moec.runtime.decode import DecodeEngine, bucket_for, evaluate_dec
from moec.runtime.kivi import KIVICodec
from moec.runtime.kvcache import FP16Cache
from moec.runtime.kvtiered import TieredKVCache, tiered_cache_factory
from moec.runtime.nuq import FIXED_LEVELS, NUQOutlierCodec
from moec.runtime.perplexity import evaluate, make_windows

W = 96  # a shortened window: 32 context + 63 decode steps, 3 history blocks at window 32 / block 16


@pytest.fixture(scope="module")
def demo():
    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
    from moec.runtime.loader import load_model

    d = resolve_model("demo-moe")
    model, _ = load_model(d)
    ids = tokenize(load_tokenizer(d), load_text("ptb", "test"))
    return model, make_windows(ids, W, max_windows=2)


def test_fp16_cache_kernel_matches_torch_path(monkeypatch):
    """FP16Cache (static mode) attend through the fp16 decode-attention kernel (MOEC_KERNELS=1; the interpreter on
    the CPU) equals the torch path step by step: outputs, and the cache the kernel writes."""
    from moec.runtime.config import ModelArgs

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=32,
                  max_seq_len=64, n_experts=2, top_k=1, expert_dim=32)
    import moec.kernels.fp16_decode_attention as fk

    calls = []
    real = fk.fp16_decode_attention
    monkeypatch.setattr(fk, "fp16_decode_attention", lambda *x, **kw: calls.append(1) or real(*x, **kw))
    caches = {m: FP16Cache(a, 2, 64, device=dev, mode="static") for m in ("0", "1")}
    g = torch.Generator().manual_seed(0)
    for c in caches.values():
        c.pos = torch.tensor([0, 0], device=dev)
    pre = [torch.randn(2, 10, 32, generator=g) for _ in range(2)]  # a 10-token prefix on row 0, 3 on row 1
    for c in caches.values():
        c.prefill_row(0, 0, pre[0].half().to(dev), pre[1].half().to(dev))
        c.prefill_row(1, 0, pre[0][:, :3].half().to(dev), pre[1][:, :3].half().to(dev))
    for step in range(4):
        q, k, v = (torch.randn(2, n, 1, 32, generator=g).to(dev) for n in (8, 2, 2))
        outs = {}
        for m, c in caches.items():
            monkeypatch.setenv("MOEC_KERNELS", m)
            c.pos = torch.tensor([10 + step, 3 + step], device=dev)
            outs[m] = c.attend(0, q, k, v)
        torch.testing.assert_close(outs["1"], outs["0"], atol=2e-3, rtol=2e-3)
    assert torch.equal(caches["0"].k[0], caches["1"].k[0]) and torch.equal(caches["0"].v[0], caches["1"].v[0])
    assert len(calls) == 4  # the kernel ran on every MOEC_KERNELS=1 step, and only there


def test_fp16_engine_matches_reference(demo):
    model, windows = demo
    ref = evaluate(model, windows, "dec", batch_size=2)
    got = evaluate_dec(model, windows, lambda B, n: FP16Cache(model.args, B, n, mode="static"), batch_size=2)
    assert got["scored_tokens"] == ref["scored_tokens"]
    assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-3), (got, ref)


@pytest.mark.parametrize("codec,rope", [("nuq-outlier", "pre"), ("kivi", None), ("kivi-rot", None)])
def test_tiered_engine_matches_reference(demo, codec, rope):
    """kivi-rot: Hadamard-rotated kivi (the static torch path's rotated basis against the dynamic path's)."""
    model, windows = demo
    a = model.args
    g = torch.Generator().manual_seed(0)
    if codec == "kivi":
        codecs = [KIVICodec(2, a.head_dim, 16) for _ in range(a.n_layers)]
    elif codec == "kivi-rot":
        codecs = [KIVICodec(2, a.head_dim, 16, block_hadamard(a.head_dim, seed=i)) for i in range(a.n_layers)]
    else:
        lev = torch.tensor(FIXED_LEVELS[2])
        codecs = [NUQOutlierCodec(2, a.head_dim, 16, lev, lev, torch.rand(a.n_kv_heads, a.head_dim, generator=g) + 0.5,
                                  0.01) for _ in range(a.n_layers)]
    sec = {"codec": codec.removesuffix("-rot"), "window": 32, "sinks": 4, "block": 16, "rope": rope}
    ref = evaluate(model, windows, "dec", batch_size=2, cache_factory=tiered_cache_factory(sec, codecs))
    got = evaluate_dec(model, windows, lambda B, n: TieredKVCache(a, B, n, codecs, 32, 4, 16, rope == "pre",
                                                                  mode="static"), batch_size=2)
    assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-3), (got, ref)


def test_rows_at_different_lengths(demo):
    """Two rows with different prompt lengths decode in one step each at its own position: the same
    logits as decoding each row alone."""
    model, windows = demo
    a = model.args
    lev = torch.tensor(FIXED_LEVELS[2])
    codecs = [NUQOutlierCodec(2, a.head_dim, 16, lev, lev, torch.ones(a.n_kv_heads, a.head_dim), 0.01)
              for _ in range(a.n_layers)]

    def cache(B):
        return TieredKVCache(a, B, 128, codecs, 32, 4, 16, True, mode="static")

    both = DecodeEngine(model, cache(2))
    lens = (37, 60)
    for r, n in enumerate(lens):
        both.prefill(r, windows[r, :n])
    alone = [DecodeEngine(model, cache(1)) for _ in lens]
    for r, n in enumerate(lens):
        alone[r].prefill(0, windows[r, :n])
    # Batched and single-row matmuls sum in another order; the ~1e-6 K/V differences can flip a 2-bit code
    # near a rounding boundary, which moves logits by ~1e-3. A wrong position or slot moves them by ~1.
    for t in range(30):  # crosses block boundaries at different steps for the two rows
        for r, n in enumerate(lens):
            both.tokens[r] = windows[r, n + t]
            alone[r].tokens[0] = windows[r, n + t]
        lb = both.step(2).clone()
        for r in range(2):
            la = alone[r].step(1)[0]
            torch.testing.assert_close(lb[r], la, rtol=1e-2, atol=1e-2)
    assert both.cache.n_blocks == [alone[0].cache.n_blocks[0], alone[1].cache.n_blocks[0]]


def test_buckets_and_random_fill(demo):
    model, _ = demo
    assert [bucket_for(b, 16) for b in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert bucket_for(3, 3) == 3
    a = model.args
    codecs = [NUQOutlierCodec(2, a.head_dim, 32, torch.tensor(FIXED_LEVELS[2]), torch.tensor(FIXED_LEVELS[2]),
                              torch.ones(a.n_kv_heads, a.head_dim), 0.01) for _ in range(a.n_layers)]
    c = TieredKVCache(a, 1, 1024, codecs, 128, 4, 32, mode="static")
    c.fill_random(0, 1000)
    assert c.n_blocks[0] == (1000 - 4 - 128) // 32 and int(c.hist_len[0]) == c.n_blocks[0] * 32
    fp = FP16Cache(a, 1, 1024, mode="static")
    fp.fill_random(0, 1000)
    # 2-bit codes + fp16 value scales + 1% outliers: ~5x fewer bytes than fp16 over the history
    assert fp.bytes_read(range(1)) > 4 * (c.bytes_read(range(1)) - 160 * FP16Cache.bytes_per_token(a))
    eng = DecodeEngine(model, c)  # a step over random history runs and gives finite logits
    eng.pos[0] = 1000
    assert torch.isfinite(eng.step(1)).all()


def test_split_attention_equals_masked_sdpa():
    """The GPU's split-K attention over the fp16 cache (plain torch, so it runs here too) vs masked SDPA."""
    import torch.nn.functional as F

    from moec.runtime.kvcache import SPLIT, split_attention

    g = torch.Generator().manual_seed(0)
    b, K, G, S, d = 3, 2, 4, 4 * SPLIT, 64
    q, k, v = (torch.randn(*s, generator=g) for s in ((b, K, G, d), (b, K, S, d), (b, K, S, d)))
    pos = torch.tensor([0, SPLIT + 7, S - 1])  # a single key, a partial chunk, the full cache
    mask = (torch.arange(S)[None] <= pos[:, None])[:, None, None]
    torch.testing.assert_close(split_attention(q, k, v, pos), F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               rtol=1e-5, atol=1e-5)


def test_quantized_dense_mlp_takes_the_fused_kernel(monkeypatch):
    """A quantized dense MLP in the static step (decode.graph_safe_moe) runs the fused MoE kernels as one
    always-taken expert (MOEC_KERNELS=1; the interpreter on the CPU), equal to its reference forward."""
    from moec.calibrate.recipe import load_recipe
    from moec.runtime.config import ModelArgs
    from moec.runtime.decode import graph_safe_moe
    from moec.runtime.latency import random_model

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = ModelArgs(arch="qwen3_moe", vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
                  ffn_kinds=["dense"], dense_dim=64)
    model = random_model(a, load_recipe("experts-hls2").rule_for, "cpu", dtype=torch.float32)
    moe = model.layers[0].moe
    assert moe.codec is not None
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    want = moe(x, 0)
    import moec.kernels.moe_decode as md

    calls = []
    real = md.moe_decode
    monkeypatch.setattr(md, "moe_decode", lambda *p, **kw: calls.append(1) or real(*p, **kw))
    monkeypatch.setenv("MOEC_KERNELS", "1")
    got = graph_safe_moe(moe, x, 0)
    assert calls, "the fused decode kernel did not run"
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
