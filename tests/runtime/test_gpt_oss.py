"""gpt-oss in moec's engine (issue 36): the sliding-window layers' cache never outgrows its window in any
mode, every mode gives the full forward's logits past the window, and calibrate → pack → load runs on it
through the engine (biased experts: their Hessians see the biased, clamped activation; the biases, sinks and
router bias are kept as they are)."""

import json
from pathlib import Path

import pytest
import torch

import moec
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.calibrate.run import calibrate, check_kv_attention
from moec.errors import UserError
from moec.runtime.decode import DecodeEngine
from moec.runtime.experts import ExpertWeights
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.kvcache import FP16Cache, LayerSplitCache
from moec.runtime.kvtiered import tiered_cache_factory
from moec.runtime.loader import load_model
from moec.runtime.model import build_model
from moec.runtime.nuq import FIXED_LEVELS, NUQOutlierCodec
from tests.runtime.tiny_hf import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss")
    make_tiny("gpt_oss", path)
    ckpt = HFCheckpoint(path)
    return ckpt.args, build_model(ckpt.args, ckpt.state_dict())


def test_window_layer_holds_its_window_in_every_mode(tiny):
    args, model = tiny
    assert args.layer_windows == [8, 0] and args.attn_sinks
    T = 40
    tokens = torch.randint(0, args.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        dyn = FP16Cache(args, 2, T, dtype=torch.float32)
        steps = [model(tokens[:, :11], dyn, 0)]  # a prefill past the window, then one token at a time
        for t in range(11, T):
            steps.append(model(tokens[:, t : t + 1], dyn, t))
            assert dyn.k[0].shape[2] == 8 and dyn.v[0].shape[2] == 8  # the ring, whatever the context
        sim = FP16Cache(args, 2, T, dtype=torch.float32, mode="simulated")
        simulated = model(tokens, sim, 0)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-4
    assert (simulated - full).abs().max() < 1e-4
    # bytes: the window layer holds 8 tokens, the full layer all 40 (K and V, 2 heads of 16, fp32)
    assert dyn.stored_bytes() == 2 * (8 + T) * 2 * 2 * 16 * 4
    static = FP16Cache(args, 1, T, dtype=torch.float32, mode="static")
    eng = DecodeEngine(model, static, graphs=False, fuse=False)
    logits = [eng.prefill(0, tokens[0, :13])]
    for t in range(13, T - 1):
        eng.tokens[:1] = tokens[0, t]
        logits.append(eng.step(1)[0].clone())
    assert static.k[0].shape[2] == 8
    assert (torch.stack(logits) - full[0, 12 : T - 1]).abs().max() < 1e-4


def test_kv_codecs_that_group_layers_are_refused(tiny):
    args, _ = tiny
    check_kv_attention(args, parse_recipe({"name": "kv", "kv": {"codec": "kivi", "bits": 2}}))  # tiered: served
    recipe = load_recipe(str(Path(moec.__file__).parent / "recipes" / "kv-latent-layer-g2.yaml"))
    with pytest.raises(UserError, match="served by the tiered block codecs only"):
        check_kv_attention(args, recipe)


def _nuq_codecs(args, block: int = 4):
    lev = torch.tensor(FIXED_LEVELS[2])
    g = torch.Generator().manual_seed(0)
    return [NUQOutlierCodec(2, args.head_dim, block, lev, lev, torch.rand(args.n_kv_heads, args.head_dim, generator=g)
                            + 0.5, 0.01) for _ in range(args.n_layers)]


def test_compressed_cache_on_full_layers_only(tiny):
    """2-bit nuq on gpt-oss: the window layer stays an fp16 ring of 8, the full layer is compressed past its fp16
    sinks + window (2 + 28, blocks of 4: more than the simulated protocol's 32-token prefill); sinks reach every
    path: before any history exists the compressed cache gives the full forward's logits (fp16 keys/values), and
    dynamic decode, simulated decode and the static engine agree after the history grows."""
    args, model = tiny
    T = 64
    codecs = _nuq_codecs(args)
    sec = {"codec": "nuq-outlier", "window": 28, "sinks": 2, "block": 4, "rope": None}
    tokens = torch.randint(0, args.vocab_size, (2, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        dyn = tiered_cache_factory(sec, codecs)(model, 2, T)
        assert isinstance(dyn, LayerSplitCache) and dyn.inner.args.n_layers == 1 and dyn.ring.k[0].shape[2] == 8
        steps = [model(tokens[:, :11], dyn, 0)]  # 11 < 2 + 28 + 4: nothing encoded yet
        assert (steps[0] - full[:, :11]).abs().max() < 2e-2
        for t in range(11, T):
            steps.append(model(tokens[:, t : t + 1], dyn, t))
        dec = torch.cat(steps, 1)
        assert dyn.inner.n_blocks[0] >= 7 and dyn.ring.k[0].shape[2] == 8
        sim = model(tokens, tiered_cache_factory(sec, codecs, mode="simulated")(model, 2, T), 0)
    assert (sim - dec).abs().max() < 2e-3
    assert (dec - full).abs().max() > 1e-2  # the history is compressed: not the fp16 logits
    eng_cache = tiered_cache_factory(sec, codecs, mode="static")(model, 1, T)
    eng = DecodeEngine(model, eng_cache, graphs=False, fuse=False)
    logits = [eng.prefill(0, tokens[0, :11])]
    for t in range(11, T - 1):
        eng.tokens[:1] = tokens[0, t]
        logits.append(eng.step(1)[0].clone())
    assert (torch.stack(logits) - dec[0, 10 : T - 1]).abs().max() < 2e-3


def test_calibrate_pack_load_through_the_engine(tiny_gpt_oss_dir, tmp_path):
    """2-bit hls experts fitted on the engine path; the packed model keeps sinks, router and expert biases
    bit for bit and computes the source model with each W replaced by its W_hat (logits), and its dequantized
    experts stay close to the source's."""
    recipe = parse_recipe({"name": "oss-hls3", "weights": [{"targets": ["experts"], "codec": "hls", "bits": 3,
                                                            "group_size": 0}]})
    calibrate(tiny_gpt_oss_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, tmp_path / "calib")
    pack(tiny_gpt_oss_dir, "tiny", tmp_path / "calib", tmp_path / "packed")
    man = json.loads((tmp_path / "packed" / "moec.json").read_text())
    assert man["model_args"]["layer_windows"] == [8, 0] and man["model_args"]["expert_act"] == "clamped_swiglu"
    model, _ = load_model(tmp_path / "packed")
    src_ckpt = HFCheckpoint(tiny_gpt_oss_dir)
    src = src_ckpt.state_dict()
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in ("layers.0.attn.sinks", "layers.1.moe.router.bias", "layers.0.moe.b1", "layers.1.moe.b2"):
        assert torch.equal(got[name].float(), src[name].float()), name
    ref = dict(src)
    for i, blk in enumerate(model.layers):
        assert isinstance(blk.moe.codec, ExpertWeights)
        for w in ("w1", "w3", "w2"):
            W_hat = getattr(blk.moe.codec, w).dequant_ref()
            rel = (W_hat - src[f"layers.{i}.moe.{w}"].float()).norm() / src[f"layers.{i}.moe.{w}"].float().norm()
            assert rel < 0.35, (i, w, rel)  # 3-bit non-uniform levels, one table per row
            ref[f"layers.{i}.moe.{w}"] = W_hat
    reference = build_model(src_ckpt.args, {k: v.float() for k, v in ref.items()})
    tokens = torch.randint(0, src_ckpt.args.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model.float()(tokens) - reference(tokens)).abs().max() < 1e-3


def test_shipped_mxfp4_experts_load_exactly_and_refit_to_themselves(tmp_path):
    """OpenAI ships gpt-oss's experts as MXFP4 `*_blocks` / `*_scales` (rows = outputs, gate and up rows
    interleaved): the engine's loader gives transformers' own dequantization of them, and the mxfp4 codec refits
    those weights to the same values (round to nearest and the Hessian-aware fit alike: every weight is an e2m1
    value times its block's power of two, so the shipped experts pass through `pack` unchanged in value)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moec.calibrate.fp4 import quantize_mx
    from moec.runtime.fp4 import dequantize_mxfp4

    make_tiny("gpt_oss", tmp_path, hidden_size=64, intermediate_size=32)  # whole 32-input blocks
    f = next(tmp_path.glob("*.safetensors"))
    state = load_file(str(f))
    g = torch.Generator().manual_seed(7)
    shipped = {}
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        E, D, I2 = state[p + "gate_up_proj"].shape
        for name, (O, n_in) in (("gate_up_proj", (I2, D)), ("down_proj", (D, I2 // 2))):
            del state[p + name]
            G = n_in // 32
            blocks = torch.randint(0, 256, (E, O, G, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(118, 130, (E, O, G), dtype=torch.uint8, generator=g)
            state[p + name + "_blocks"], state[p + name + "_scales"] = blocks, scales
            shipped[(i, name)] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    save_file(state, str(f), metadata={"format": "pt"})
    sd = HFCheckpoint(tmp_path).state_dict()
    for i in range(2):
        gate_up, down = shipped[(i, "gate_up_proj")], shipped[(i, "down_proj")]  # [E, 2I, D], [E, D, I]
        assert torch.equal(sd[f"layers.{i}.moe.w1"].float(), gate_up[:, 0::2])
        assert torch.equal(sd[f"layers.{i}.moe.w3"].float(), gate_up[:, 1::2])
        assert torch.equal(sd[f"layers.{i}.moe.w2"].float(), down)
    W = sd["layers.0.moe.w1"].float()
    E, O, n_in = W.shape
    H = torch.eye(n_in).expand(E, n_in, n_in) + 0.1  # any positive definite Hessian
    for gptq in (False, True):
        parts = quantize_mx(W, H if gptq else None, gptq)
        assert torch.equal(dequantize_mxfp4(4, (E, O, n_in), parts), W), gptq


@pytest.mark.parametrize("kv", ["fp16", "nuq"])
def test_static_engine_kernels_match_torch_path(kv, monkeypatch):
    """The static engine on gpt-oss with the kernels (MOEC_KERNELS=1, the interpreter on the CPU: the fused step,
    the fp16 decode kernel on the window layer's ring with the sinks in the split combine, the tiered 2-bit
    kernel on the full layer past its history, the dense-mode MoE kernels with biases and the clamped SwiGLU)
    gives the torch path's logits step by step."""
    from moec.runtime.config import ModelArgs
    from moec.runtime.latency import random_model

    args = ModelArgs(arch="gpt_oss", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=32, qkv_bias=True, o_bias=True,
                     attn_sinks=True, layer_windows=[8, 0], router_score="softmax_topk", router_logit_bias=True,
                     expert_bias=True, expert_act="clamped_swiglu", swiglu_limit=1.0, norm_topk=False)
    model = random_model(args, lambda name: None, "cpu", torch.float32, seed=8)
    with torch.no_grad():
        for blk in model.layers:
            blk.attn.sinks.normal_(0, 2, generator=torch.Generator().manual_seed(blk.layer))
    tokens = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(9))
    sec = {"codec": "nuq-outlier", "window": 32, "sinks": 4, "block": 16, "rope": None}
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MOEC_KERNELS", mode)
        cache = (FP16Cache(args, 1, 80, device="cpu", mode="static") if kv == "fp16"
                 else tiered_cache_factory(sec, _nuq_codecs(args, 16), mode="static")(model, 1, 80))
        eng = DecodeEngine(model, cache, graphs=False)
        logits = [eng.prefill(0, tokens[:60])]
        for t in tokens[60:]:
            eng.tokens[:1] = t
            logits.append(eng.step(1)[0].clone())
        out[mode] = torch.stack(logits)
        if kv == "nuq":
            assert cache.inner.use_kernel == (mode == "1") and int(cache.inner.hist_len[0]) > 0
    torch.testing.assert_close(out["1"], out["0"], atol=2e-3, rtol=2e-3)


def test_split_cache_bytes_per_token_of_capacity(tiny):
    """The memory planner's measured bytes per token of capacity (latency.static_bytes_per_token) sees both parts of
    the split cache, and the window layers' part does not grow with the capacity: a token of capacity costs about
    what the full layer alone costs, about half of the same cache without windows (two full layers)."""
    import dataclasses

    from moec.runtime.latency import allocated_bytes, static_bytes_per_token

    args, model = tiny
    sec = {"codec": "nuq-outlier", "window": 8, "sinks": 2, "block": 4, "rope": None}
    make = tiered_cache_factory(sec, _nuq_codecs(args), mode="static")
    split = static_bytes_per_token(lambda b, n: make(model, b, n), 64, 128)
    assert allocated_bytes(make(model, 1, 64).ring) == allocated_bytes(make(model, 1, 128).ring)
    model.args = dataclasses.replace(args, layer_windows=[0, 0])  # the same model read as two full layers
    try:
        both = static_bytes_per_token(lambda b, n: make(model, b, n), 64, 128)
    finally:
        model.args = args
    assert 0.45 * both < split < 0.55 * both, (split, both)
