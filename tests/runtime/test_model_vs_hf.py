"""The canonical runtime against transformers' own forward, for every supported architecture.

Tolerance: both run in fp32 on the CPU; they differ only in summation order (SDPA vs eager softmax,
stacked vs per-expert matmuls), which leaves ~1e-6 relative error per op. Over 2 layers and logits of
magnitude ~10 we allow 1e-4 absolute; a wrong RoPE, norm or routing convention shows up as O(1).
"""

import pytest
import torch

from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.kvcache import dense_cache
from moec.runtime.model import build_model
from tests.runtime.tiny_hf import make_tiny, tiny_configs

ARCHS = list(tiny_configs())


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    ref = make_tiny(arch, tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    model = build_model(ckpt.args, ckpt.state_dict())
    tokens = torch.randint(0, ckpt.args.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens)
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{arch}: max |Δlogit| = {err:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_matches_prefill(arch, tmp_path):
    make_tiny(arch, tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    model = build_model(ckpt.args, ckpt.state_dict())
    T = 29
    tokens = torch.randint(0, ckpt.args.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    cache = dense_cache(ckpt.args, batch=2, max_len=T, dtype=torch.float32)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :5], cache, 0)]  # a multi-token prefill, then one token at a time
        steps += [model(tokens[:, t : t + 1], cache, t) for t in range(5, T)]
    dec = torch.cat(steps, dim=1)
    err = (dec - full).abs().max().item()
    assert err < 1e-4, f"{arch}: decode vs prefill max |Δlogit| = {err:.3g}"


def test_unsupported_architecture(tmp_path):
    import json

    from moec.errors import UserError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'; supported: llama, mixtral"):
        HFCheckpoint(tmp_path)
