"""Greedy generation from the runtime equals transformers' `generate`, token for token.

64 greedy tokens from tiny random HF models (fp32, eager attention in HF): with an fp32 KV cache the
two are the same math up to summation order, so the argmax sequences agree exactly unless two logits
tie to ~1e-6 (the weights are drawn wide, tests/runtime/tiny_hf.py, so near ties are rare; seeds fixed).
A position bug, a stale cache row or a wrong RoPE table diverges within a few tokens.
"""

import pytest
import torch

from moec.runtime.generate import generate
from moec.runtime.loader import load_model

from .tiny_hf import make_tiny


@pytest.mark.parametrize("arch", ["mixtral", "llama", "qwen3_moe"])
def test_greedy_matches_transformers(arch, tmp_path):
    hf = make_tiny(arch, tmp_path)
    hf.generation_config.eos_token_id = None
    prompt = torch.randint(0, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    model, _ = load_model(tmp_path)
    got = generate(model, prompt[0], 64, kv_dtype=torch.float32)
    assert got == ref


def test_static_and_dynamic_paths_agree_with_tiered_cache(tmp_path):
    """The static engine and the dynamic TieredKVCache produce the same greedy tokens (nuq-outlier, pre-RoPE keys)."""
    from moec.runtime.kvtiered import tiered_cache_factory
    from moec.runtime.nuq import FIXED_LEVELS, NUQOutlierCodec

    make_tiny("mixtral", tmp_path)
    model, _ = load_model(tmp_path)
    a = model.args
    lev = torch.tensor(FIXED_LEVELS[2])
    g = torch.Generator().manual_seed(0)
    codecs = [NUQOutlierCodec(2, a.head_dim, 16, lev, lev, torch.rand(a.n_kv_heads, a.head_dim, generator=g) + 0.5,
                              0.02) for _ in range(a.n_layers)]
    kv = {"codec": "nuq-outlier", "bits": 2, "window": 16, "sinks": 4, "block": 16, "rope": "pre"}
    prompt = torch.arange(40) % a.vocab_size
    static = generate(model, prompt, 48, kv=kv, codecs=codecs)
    dynamic = generate(model, prompt, 48, cache_factory=tiered_cache_factory(kv, codecs))
    assert static == dynamic


def test_sampling_is_seeded(tmp_path):
    make_tiny("llama", tmp_path)
    model, _ = load_model(tmp_path)
    a = generate(model, [1, 2, 3], 20, temperature=1.0, seed=5)
    b = generate(model, [1, 2, 3], 20, temperature=1.0, seed=5)
    c = generate(model, [1, 2, 3], 20, temperature=1.0, seed=6)
    assert a == b and a != c and len(a) == 20
