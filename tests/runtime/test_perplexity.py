"""The eval protocol: decode mode through the uncompressed (fp16) cache equals teacher forcing.

docs/benchmarks.md: with an uncompressed cache ppl_dec equals ppl_tf to ~1e-3 relative. The fp16 cache
rounds K/V to 11 significant bits (relative 2^-11 ≈ 5e-4 per element); those errors average out in
attention, leaving ppl differences of ~1e-4 relative, so 1e-3 is a bound with margin that a real
decode bug (wrong position, stale cache row, off-by-one scoring) exceeds by orders of magnitude.
"""

import math

import pytest
import torch

from moec.runtime.kvcache import FP16Cache
from moec.runtime.loader import load_model
from moec.runtime.perplexity import CONTEXT, evaluate, layer_progress, make_windows, shares


def test_make_windows_drops_partial_tail():
    w = make_windows(torch.arange(1000), 300)
    assert w.shape == (3, 300) and w[2, -1] == 899
    assert make_windows(torch.arange(1000), 300, max_windows=2).shape == (2, 300)


def test_scored_positions_and_kl_against_itself(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir)
    windows = torch.randint(0, model.args.vocab_size, (3, 80), generator=torch.Generator().manual_seed(0))
    done = []
    r = evaluate(model, windows, "tf", baseline=model, batch_size=2, progress=done.append)
    # teacher forcing: the 48 scored positions of a window reported across its layers, inside the forward
    L = model.args.n_layers
    assert done == shares(80 - CONTEXT, L) * 3 and sum(done) == 3 * (80 - CONTEXT)
    assert r["scored_tokens"] == 3 * (80 - CONTEXT)
    assert r["kld"] == pytest.approx(0.0, abs=1e-9) and r["top1"] == 1.0 and r["delta_pct"] == 0.0
    # teacher forcing by hand: mean NLL of tokens 32..79 given their prefixes
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).float(), -1)
    nll = -logp[:, CONTEXT - 1 : -1].gather(-1, windows[:, CONTEXT:, None]).mean().item()
    assert r["ppl"] == pytest.approx(math.exp(nll), rel=1e-6)


def test_dec_equals_tf_tiny(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir)
    windows = torch.randint(0, model.args.vocab_size, (3, 100), generator=torch.Generator().manual_seed(1))
    tf = evaluate(model, windows, "tf")
    done = []
    # batches of 2 and 1: each window its own cache row
    dec = evaluate(model, windows, "dec", batch_size=2, progress=done.append)
    # decode: every position of a batch's windows as it is decoded (68 = 100 - 32 scored positions each)
    assert done == [2] * 68 + [1] * 68
    assert dec["ppl"] == pytest.approx(tf["ppl"], rel=1e-3)
    assert dec["kv_bits"] == 16.0


def test_fp32_cache_decode_is_exact_to_rounding(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir)
    windows = torch.randint(0, model.args.vocab_size, (2, 70), generator=torch.Generator().manual_seed(2))

    def fp32_cache(m, b, n):
        return FP16Cache(m.args, b, n, dtype=torch.float32)

    tf = evaluate(model, windows, "tf")
    dec = evaluate(model, windows, "dec", cache_factory=fp32_cache)
    assert dec["ppl"] == pytest.approx(tf["ppl"], rel=1e-5)
    assert dec["kv_bits"] == 32.0


@pytest.mark.slow
def test_dec_equals_tf_smollm2():
    """On the real SmolLM2-135M and real PTB text (one 256-token window: the protocol, shortened)."""
    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize

    d = resolve_model("smollm2-135m")
    model, info = load_model(d)
    assert info["w_bits"] == 32.0  # GGUF dequantized to fp32 (not every value is representable in fp16)
    ids = tokenize(load_tokenizer(d), load_text("ptb", "test"))
    windows = make_windows(ids, 256, max_windows=1)
    tf = evaluate(model, windows, "tf")
    dec = evaluate(model, windows, "dec")
    assert dec["ppl"] == pytest.approx(tf["ppl"], rel=1e-3), (tf, dec)
    # SmolLM2-135M on the first 256 PTB-test tokens gives ~156 (75.9 over a full 1024-token window,
    # where more context helps); a broken model is near the vocabulary size (49152) or in the thousands.
    assert 50 < tf["ppl"] < 300, tf


def test_layer_progress_reports_inside_a_forward_and_leaves_no_hook(tiny_moe_dir):
    """One forward over a long window (tf, simulated decode) reports its positions after each layer, in
    integer shares that add up; the hooks go when the block ends, also after an error."""
    assert shares(48, 5) == [9, 10, 9, 10, 10] and shares(2, 4) == [0, 1, 0, 1]
    model, _ = load_model(tiny_moe_dir)
    seen = []
    x = torch.zeros(1, 40, dtype=torch.long)
    with torch.no_grad(), layer_progress(model, lambda n: seen.append((n, len(seen))), 10):
        model(x)
    assert [n for n, _ in seen] == [s for s in shares(10, model.args.n_layers) if s]
    with pytest.raises(RuntimeError), layer_progress(model, seen.append, 10):
        raise RuntimeError("interrupted")
    assert not any(b._forward_hooks for b in model.layers)
    with torch.no_grad():
        model(x)
    assert len(seen) == len([s for s in shares(10, model.args.n_layers) if s])  # nothing reported outside
