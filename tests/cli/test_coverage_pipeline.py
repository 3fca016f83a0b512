"""calibrate → pack → load → eval for the targets beyond routed experts and attention (issue 17 item 5):
shared experts, dense MLPs of a MoE model (Qwen2-MoE `mlp_only_layers`), the router and the LM head, on a
tiny random Qwen2-MoE with tied embeddings (conftest.tiny_qwen2_moe_dir). No real shared-expert model is
available here, so the checks are mechanical: the packed model computes the source model with every
quantized W replaced by its dequantized W_hat (rotations undone), its perplexity stays near the source's,
the decode engine gives the torch path's logits, and the input embedding of the tied model is untouched."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from moec.calibrate.fit_experts import plan
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.calibrate.run import calibrate
from moec.calibrate.sources import load_tokenizer, tokenize
from moec.errors import UserError
from moec.rotation import rotate, unpack_signs
from moec.runtime.decode import DecodeEngine
from moec.runtime.experts import dequantize
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.kvcache import FP16Cache
from moec.runtime.loader import load_model
from moec.runtime.model import build_model
from moec.runtime.perplexity import evaluate, make_windows
from tests.cli.run import moec

RULES = [{"targets": ["experts", "shared_experts", "mlp"], "codec": "hls", "bits": 3, "group_size": 0,
          "incoherence": {}},
         {"targets": ["router"], "codec": "fp8", "bits": 8, "incoherence": {"block": 16}},
         {"targets": ["lm_head"], "codec": "rtn", "bits": 4, "group_size": 16, "incoherence": {"block": 16}}]
QUANTIZED = {"layers.0.moe.w1", "layers.0.moe.w2", "layers.0.moe.w3", "layers.1.moe.w1", "layers.1.moe.w2",
             "layers.1.moe.w3", "layers.0.moe.shared.w1.weight", "layers.0.moe.shared.w2.weight",
             "layers.0.moe.shared.w3.weight", "layers.0.moe.router.weight", "output.weight"}


@pytest.fixture(scope="module")
def packed(tiny_qwen2_moe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coverage")
    recipe = parse_recipe({"name": "coverage", "weights": RULES})
    calibrate(tiny_qwen2_moe_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, tmp / "calib")
    pack(tiny_qwen2_moe_dir, "tiny", tmp / "calib", tmp / "packed")
    return tmp / "packed"


def _stored(path) -> dict:
    out = {}
    for f in path.glob("model-*.safetensors"):
        out.update(load_file(str(f)))
    return out


def _reference(src_dir, packed_dir):
    """The source model (fp32) with every quantized W replaced by its dequantized W_hat·Rᵀ, untied."""
    man = json.loads((packed_dir / "moec.json").read_text())
    stored = _stored(packed_dir)
    src = HFCheckpoint(src_dir).state_dict()
    src["output.weight"] = src["tok_embeddings.weight"]  # the tied head, quantized apart from the embedding
    params = {e["param"] for e in man["tensors"].values() if e["codec"] != "keep"}
    assert params == QUANTIZED, sorted(params ^ QUANTIZED)
    for name in params:
        e = next(e for e in man["tensors"].values() if e["param"] == name)
        parts = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
        signs = parts.pop("had_signs", None)
        flat = src[name].dim() == 2
        W = dequantize(e["codec"], e["bits"], (1, *src[name].shape) if flat else tuple(src[name].shape),
                       {k: v[None] for k, v in parts.items()} if flat else parts)
        if signs is not None:  # bit-packed signs (rotation.pack_signs)
            W = rotate(W, unpack_signs(signs, src[name].shape[-1]), inverse=True)
        src[name] = W.reshape(src[name].shape)
    model, _ = load_model(packed_dir)
    return model, build_model(model.args, src, dtype=torch.float32)


def test_plan_tells_experts_from_dense_mlps(tiny_qwen2_moe_dir):
    """On a model with MoE and dense layers `experts` names the MoE layer's stacked matrices only, `mlp`
    the dense layer's; shared experts, router and the (tied) LM head each by their own target."""
    args = HFCheckpoint(tiny_qwen2_moe_dir).args
    assert args.ffn_kinds == ["moe", "dense"] and args.tie_embeddings
    got = {t: set(plan(args, parse_recipe({"weights": [{"targets": [t], "codec": "rtn", "bits": 4}]})))
           for t in ("experts", "mlp", "shared_experts", "router", "lm_head")}
    assert got == {"experts": {"layers.0.moe.w1", "layers.0.moe.w2", "layers.0.moe.w3"},
                   "mlp": {"layers.1.moe.w1", "layers.1.moe.w2", "layers.1.moe.w3"},
                   "shared_experts": {f"layers.0.moe.shared.w{i}.weight" for i in (1, 2, 3)},
                   "router": {"layers.0.moe.router.weight"}, "lm_head": {"output.weight"}}
    # the shipped recipe for shared-expert models is the first rule of the pipeline below
    full = load_recipe(Path(__file__).parents[2] / "moec" / "recipes" / "ablations" / "experts-hls3-had-full.yaml")
    assert set(plan(args, full)) == got["experts"] | got["mlp"] | got["shared_experts"]
    assert full.weights[0] == parse_recipe({"weights": RULES[:1]}).weights[0]
    with pytest.raises(UserError, match="quantizes only .* and LM-head matrices"):  # the [1, D] shared gate
        plan(args, parse_recipe({"weights": [{"targets": ["shared_gate"], "codec": "rtn", "bits": 4}]}))


def test_packed_matches_dequantized_reference(tiny_qwen2_moe_dir, packed):
    model, ref = _reference(tiny_qwen2_moe_dir, packed)
    assert type(model.output).__name__ == "QLinear" and type(model.layers[0].moe.shared.w2).__name__ == "QLinear"
    x = torch.randint(0, model.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    # the tied model is untied in the packed copy: the input embedding exactly as the source stores it
    src = HFCheckpoint(tiny_qwen2_moe_dir).state_dict()
    stored = _stored(packed)
    assert torch.equal(stored["tok_embeddings.weight"], src["tok_embeddings.weight"])
    assert "output.weight" not in stored and "output.weight.codes" in stored
    man = json.loads((packed / "moec.json").read_text())
    assert man["model_args"]["tie_embeddings"] is False
    assert json.loads((packed / "config.json").read_text())["tie_word_embeddings"] is False
    assert "layers.0.moe.shared_gate.weight" in stored  # the [1, D] gate stays as it is


def test_perplexity_near_source_and_decode_engine(tiny_qwen2_moe_dir, packed):
    model, _ = load_model(packed)
    source, _ = load_model(tiny_qwen2_moe_dir)
    ids = tokenize(load_tokenizer(tiny_qwen2_moe_dir), " ".join(["the market closed higher on friday"] * 40))
    windows = make_windows(ids, 48, max_windows=2)
    got, base = evaluate(model, windows, "tf"), evaluate(source, windows, "tf")
    # measured +0.55% (hls3 experts/shared/MLP, fp8 router, rtn4 head); a wrong rotation or Hessian: far more
    assert torch.isfinite(torch.tensor(got["ppl"])) and abs(got["ppl"] / base["ppl"] - 1) < 0.05, (got, base)

    # the decode engine (prefill, then one token at a time) equals the torch forward over the whole window
    seq = windows[0]
    eng = DecodeEngine(model, FP16Cache(model.args, 1, seq.numel(), mode="static"))
    logits = [eng.prefill(0, seq[:16])]
    for t in range(16, 24):
        eng.tokens[:1] = seq[t]
        logits.append(eng.step(1)[0].clone())
    with torch.no_grad():
        full = model(seq[None, :24])[0, 15:24]
    # K/V are held in fp16 by the engine's cache: ~1e-3 relative
    torch.testing.assert_close(torch.stack(logits), full, rtol=2e-3, atol=2e-3)


def test_decode_engine_kernel_step(packed, monkeypatch):
    """One decode step through the kernels (MOEC_KERNELS=1; Triton's interpreter on the CPU): the shared
    expert's and the head's qlinear GEMV, the routing kernel, the fused MoE GEMV, against the torch
    step. The prompt is prefilled by the torch path (the interpreter's prefill kernels take minutes)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, _ = load_model(packed)
    seq = torch.randint(0, model.args.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MOEC_KERNELS", "0")
        eng = DecodeEngine(model, FP16Cache(model.args, 1, 16, mode="static"), graphs=False, fuse=False)
        eng.prefill(0, seq[:10])
        monkeypatch.setenv("MOEC_KERNELS", mode)
        eng.tokens[:1] = seq[10]
        out[mode] = eng.step(1)[0].clone()
    torch.testing.assert_close(out["1"], out["0"], rtol=1e-2, atol=1e-2)  # measured 2.7e-3 over 5 steps


def test_export_refuses_a_quantized_head(packed, tmp_path):
    r = moec("export", packed, "--format", "ct", "-o", tmp_path / "exported")
    assert r.returncode == 2 and "no export format here carries a quantized" in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_shared_experts_on_a_model_without_them_exits_2(tiny_moe_dir, tmp_path):
    rec = tmp_path / "shared.yaml"
    rec.write_text(yaml.safe_dump({"weights": [{"targets": ["shared_experts"], "codec": "hls", "bits": 3}]}))
    out = tmp_path / "calib"
    r = moec("calibrate", tiny_moe_dir, "--recipe", rec, "--data", "ptb", "--split", "valid", "--samples", "2",
             "--seq-len", "32", "-o", out)
    assert r.returncode == 2 and "selects no tensor of this model" in r.stderr, (r.returncode, r.stderr)
    assert "targets that exist here: experts, attention, router, lm_head" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_transformers_loads_the_quantized_shared_expert_and_head(packed):
    """moec.hf serves the quantized shared expert and LM head with the runtime's QLinear and the router
    dequantized, as the runtime does: the same logits."""
    from moec.hf import from_pretrained

    hf = from_pretrained(packed)
    rt, _ = load_model(packed)
    assert type(hf.lm_head).__name__ == "QLinear"
    assert type(hf.model.layers[0].mlp.shared_expert.down_proj).__name__ == "QLinear"
    x = torch.randint(0, rt.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, rt(x), rtol=1e-4, atol=1e-4)
