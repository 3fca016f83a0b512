"""mla-nuq, the compressed MLA latent cache (moec/runtime/mla_nuq.py): the plane layout, the codec's error, the
three modes writing the same bytes, the static step's kernel against its torch path, the engine against the
dynamic cache, the bytes at DeepSeek's dimensions, the refusals, and calibrate → pack → eval on demo-mla."""

import dataclasses
import json
import os

import pytest
import torch
import yaml

from moec.errors import FormatError, UserError
from moec.runtime.config import PRESETS, ModelArgs
from moec.runtime.mla_nuq import MLANUQCache, build_codecs, pack_planes, random_tensors, signs_for, unpack_planes

ARGS = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=48,
                 max_seq_len=256, attn_kind="mla", kv_lora_rank=64, qk_rope_dim=16, v_head_dim=32)
TIERS = dict(window=16, sinks=2, block=16)
B, S = 2, 100


def _codecs(args=ARGS):
    return build_codecs({}, random_tensors(args, {}, torch.Generator().manual_seed(0), "cpu"), args)


def test_planes_layout_and_round_trip():
    """Byte j of a part of n channels holds channels j + k·n/4 in bits 2k..2k+1 (what the kernel unpacks)."""
    codes = torch.zeros(64, dtype=torch.long)
    codes[5 + 2 * 16] = 3  # channel 5 of plane 2
    packed = pack_planes(codes)
    assert packed.shape == (16,) and packed[5].item() == 3 << 4 and packed.sum().item() == 3 << 4
    c = torch.randint(0, 4, (7, 3, 80), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_planes(pack_planes(c)), c)


def test_codec_error_bound():
    """Rotated rows, even with two latent channels 30x the rest: relative MSE within a 2-bit Gaussian Lloyd-Max
    quantizer's (0.1175) + 10%; unrotated, those channels would set every token's scale."""
    codec = _codecs()[0]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2000, ARGS.latent_dim, generator=g)
    x[:, [3, 40]] *= 30
    y = codec.rotate(x).half().float()
    codes, scales = codec.encode(y)
    assert codes.shape == (2000, 20) and codes.dtype == torch.uint8 and scales.dtype == torch.float16
    d = codec.decode(codes, scales)
    for sl in (slice(0, 64), slice(64, 80)):
        rel = ((d[:, sl] - y[:, sl]) ** 2).sum() / (y[:, sl] ** 2).sum()
        assert rel < 0.13, (sl, rel)
    back = d @ codec.R.T  # the unrotated latent the model sees
    assert ((back - x) ** 2).sum() / (x**2).sum() < 0.13


def _run(cache, prefill: int):
    """The same q and rows through `cache` in its mode (dynamic: prefill then one token per call; static:
    prefill_row, then engine steps; simulated: one forward); outputs per layer [B, H, T, r]."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, ARGS.n_heads, S, ARGS.latent_dim, generator=g)
    kv = [torch.randn(B, 1, S, ARGS.latent_dim, generator=g) * (1 + layer) for layer in range(ARGS.n_layers)]
    outs = [[] for _ in range(ARGS.n_layers)]
    with torch.no_grad():
        if cache.mode == "simulated":
            for layer in range(ARGS.n_layers):
                outs[layer].append(cache.attend(layer, q, kv[layer], None, 0))
        elif cache.mode == "dynamic":
            for layer in range(ARGS.n_layers):
                outs[layer].append(cache.attend(layer, q[:, :, :prefill], kv[layer][:, :, :prefill], None, 0))
            for t in range(prefill, S):
                for layer in range(ARGS.n_layers):
                    outs[layer].append(cache.attend(layer, q[:, :, t : t + 1], kv[layer][:, :, t : t + 1], None, t))
        else:
            cache.pos = torch.zeros(B, dtype=torch.long)
            for r in range(B):
                for layer in range(ARGS.n_layers):
                    cache.prefill_row(r, layer, kv[layer][r : r + 1, 0, :prefill])
                cache.set_length(r, prefill)
            for t in range(prefill, S):
                cache.pos.fill_(t)
                for layer in range(ARGS.n_layers):
                    outs[layer].append(cache.attend(layer, q[:, :, t : t + 1], kv[layer][:, :, t : t + 1], None, 0))
                cache.after_step(range(B))
    return [torch.cat(o, 2) for o in outs]


@pytest.mark.parametrize("prefill", [6, 60])
def test_modes_write_identical_history(prefill):
    """Per-token encoding: dynamic, static and simulated store the same codes and scales; static decode equals
    dynamic decode step by step, and simulated mode gives each query dynamic decode's view (exact when the
    prefill evicts nothing)."""
    codecs = _codecs()
    caches = {m: MLANUQCache(ARGS, B, S, codecs, mode=m, use_kernel=False, **TIERS)
              for m in ("dynamic", "static", "simulated")}
    outs = {m: _run(c, prefill) for m, c in caches.items()}
    h = 5 * 16  # blocks_at(100) = (100 - 2 - 16) // 16 = 5
    assert caches["dynamic"].n_blocks == [5, 5] and caches["static"].n_blocks == [5] * B
    for layer in range(ARGS.n_layers):
        ref = caches["dynamic"].codes[layer][:, :h], caches["dynamic"].scales[layer][:, :h]
        assert ref[0].any() and (ref[1] > 0).all()
        for m in ("static", "simulated"):
            assert torch.equal(ref[0], caches[m].codes[layer][:, :h]), (m, layer)
            assert torch.equal(ref[1], caches[m].scales[layer][:, :h]), (m, layer)
        # up to one fp16 step of a window row: the modes rotate rows by fp32 matmuls of different shapes (a token or
        # the whole prefill at once), whose last bits differ on some CPUs (AMX / AVX512-FP16 blocking) and can round
        # a stored fp16 value the other way (the codes and scales above are compared exactly)
        torch.testing.assert_close(outs["static"][layer], outs["dynamic"][layer][:, :, prefill:], atol=4e-3,
                                   rtol=1e-3)
        if prefill < 2 + 16 + 16:
            torch.testing.assert_close(outs["simulated"][layer], outs["dynamic"][layer], atol=4e-3, rtol=1e-3)


def test_static_step_kernel_matches_torch_path(monkeypatch):
    """The static step through kernels/mla_nuq_decode_attention.py (the interpreter on the CPU) equals the torch
    path step by step while blocks age out of the window; the windows and history they write are equal."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = dataclasses.replace(ARGS, n_layers=1, ffn_kinds=[])
    codecs = _codecs(a)
    caches = {k: MLANUQCache(a, 2, 96, codecs, device=dev, mode="static", use_kernel=k, window=8, sinks=2, block=16)
              for k in (False, True)}
    g = torch.Generator().manual_seed(4)
    pre = torch.randn(1, 20, a.latent_dim, generator=g)
    for c in caches.values():
        c.prefill_row(0, 0, pre.to(dev))
        c.set_length(0, 20)
        c.prefill_row(1, 0, pre[:, :3].to(dev))
        c.set_length(1, 3)
    for step in range(30):
        q = torch.randn(2, a.n_heads, 1, a.latent_dim, generator=g).to(dev)
        kv = torch.randn(2, 1, 1, a.latent_dim, generator=g).to(dev)
        outs = {}
        for k, c in caches.items():
            c.pos = torch.tensor([20 + step, 3 + step], device=dev)
            c.begin_step(2)
            outs[k] = c.attend(0, q, kv)
            c.end_step()
            c.after_step(range(2))
        torch.testing.assert_close(outs[True], outs[False], atol=2e-3, rtol=2e-3)
    assert caches[True].n_blocks == [2, 1]  # both rows aged blocks during the steps
    for name in ("win", "codes", "scales"):
        assert torch.equal(getattr(caches[True], name)[0], getattr(caches[False], name)[0]), name


@pytest.mark.parametrize("hist,win,H,block_h", [
    ([0, 0, 0], [1, 1, 1], 5, None), ([0, 0, 0], [5, 20, 40], 5, None), ([37, 50, 96], [1, 9, 40], 5, None),
    # 64 heads: the `many_heads` launch (DeepSeek-V3 has 128), and one block of 64 heads at 4 warps (at 8 it is
    # wrong on an H100 and refused: test_kernel_refuses_miscompiled_launch)
    ([50], [9], 64, None), ([50], [9], 64, 64)])
def test_kernel_matches_reference(monkeypatch, hist, win, H, block_h):
    """The kernel on random codes against the torch reference: empty history, window only, both; the query's RoPE
    part rotated in the kernel (the reference takes it rotated); the output rotated in the combine; the new row
    lands in its slot."""
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention, mla_nuq_decode_attention_ref

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    codec = _codecs()[0].to(dev)
    g = torch.Generator().manual_seed(5)
    Bq, L, r = len(hist), ARGS.latent_dim, ARGS.kv_lora_rank
    codes = torch.randint(0, 256, (Bq, 96, L // 4), generator=g, dtype=torch.uint8).to(dev)
    scales = (torch.rand(Bq, 96, 2, generator=g) + 0.5).half().to(dev)
    window = torch.randn(Bq, 40, L, generator=g).half().to(dev)
    q, new = torch.randn(Bq, H, L, generator=g).to(dev), torch.randn(Bq, L, generator=g).to(dev)
    hl, wl = torch.tensor(hist, dtype=torch.int32, device=dev), torch.tensor(win, dtype=torch.int32, device=dev)
    w_ref = window.clone()
    ref = mla_nuq_decode_attention_ref(codec.rotate_query(q), codes, scales, codec, hl, w_ref, new, wl, r, 0.3)
    warps = 4 if block_h == 64 else None
    out = mla_nuq_decode_attention(q, codes, scales, codec.levels, hl, window, new, wl, r, 0.3,
                                   rope_rotation=codec.Rr, out_dtype=torch.float32, block_h=block_h, num_warps=warps)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(window, w_ref)
    out = mla_nuq_decode_attention(codec.rotate_query(q), codes, scales, codec.levels, hl, window.clone(), new, wl,
                                   r, 0.3, out_rotation=codec.Rc, out_dtype=torch.float32, block_h=block_h,
                                   num_warps=warps)
    torch.testing.assert_close(out, ref @ codec.Rc.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hist,win", [([0, 0, 0], [5, 20, 40]), ([37, 50, 96], [1, 9, 40])])
def test_kernel_half_partials_match_reference(monkeypatch, hist, win):
    """half_partials: each split's output as fp16 acc / l (empty history splits store 0), with both rotations."""
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention, mla_nuq_decode_attention_ref

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    codec = _codecs()[0].to(dev)
    g = torch.Generator().manual_seed(6)
    Bq, L, r, H = len(hist), ARGS.latent_dim, ARGS.kv_lora_rank, 5
    codes = torch.randint(0, 256, (Bq, 96, L // 4), generator=g, dtype=torch.uint8).to(dev)
    scales = (torch.rand(Bq, 96, 2, generator=g) + 0.5).half().to(dev)
    window = torch.randn(Bq, 40, L, generator=g).half().to(dev)
    q, new = torch.randn(Bq, H, L, generator=g).to(dev), torch.randn(Bq, L, generator=g).to(dev)
    hl, wl = torch.tensor(hist, dtype=torch.int32, device=dev), torch.tensor(win, dtype=torch.int32, device=dev)
    ref = mla_nuq_decode_attention_ref(codec.rotate_query(q), codes, scales, codec, hl, window.clone(), new, wl, r,
                                       0.3)
    out = mla_nuq_decode_attention(q, codes, scales, codec.levels, hl, window, new, wl, r, 0.3,
                                   rope_rotation=codec.Rr, out_rotation=codec.Rc, out_dtype=torch.float32,
                                   half_partials=True)
    full = mla_nuq_decode_attention(q, codes, scales, codec.levels, hl, window.clone(), new, wl, r, 0.3,
                                    rope_rotation=codec.Rr, out_rotation=codec.Rc, out_dtype=torch.float32,
                                    half_partials=False)
    assert torch.isfinite(out).all() and not torch.equal(out, full)  # the fp16 partials are there: the path ran
    torch.testing.assert_close(out, ref @ codec.Rc.T, atol=2e-3, rtol=2e-3)  # fp16's 2^-11 on each split


def test_kernel_refuses_miscompiled_launch():
    """A head block of 64 at 8 warps gives wrong results on an H100 (Triton 3.6 spreads one warpgroup's 64 rows of
    wgmma over two; docs/results.md): refused in one line before any launch, on every device (64 heads at 8 warps
    in blocks of 32, the many_heads launch, run in test_kernel_matches_reference)."""
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention

    codec = _codecs()[0]
    L, r = ARGS.latent_dim, ARGS.kv_lora_rank
    codes = torch.zeros(1, 16, L // 4, dtype=torch.uint8)
    scales = torch.ones(1, 16, 2).half()
    hl, wl = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head block of 64 with 8 warps"):
        mla_nuq_decode_attention(torch.zeros(1, 64, L), codes, scales, codec.levels, hl, torch.zeros(1, 8, L).half(),
                                 torch.zeros(1, L), wl, r, 0.3, block_h=64, num_warps=8)


@pytest.mark.parametrize("fuse", [False, True])
def test_engine_matches_dynamic_cache(fuse):
    """A tiny DeepSeek-V3 through the static engine (runtime/decode.py, CPU) with the compressed latent cache:
    each step's logits equal Transformer.forward over the dynamic mode of the same cache, with history aged;
    fused: the engine's fused step (MLAttention.decode_fused, its prologue kernel under the interpreter) too.
    Up to fp16 rounding: the engine's prefill is the exact causal forward, the dynamic cache's attends over the
    fp16 rows, and layer 0's difference reaches layer 1's cached rows (logits ~4, differences < 1e-3; a wrong
    slot, rotation or history would move them by O(1))."""
    from moec.runtime.decode import DecodeEngine
    from moec.runtime.latency import random_model

    a = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=48,
                  max_seq_len=128, attn_kind="mla", q_lora_rank=32, kv_lora_rank=64, qk_rope_dim=16, v_head_dim=32,
                  dense_dim=96)
    model = random_model(a, lambda name: None, "cpu", dtype=torch.float32).eval()
    codecs = _codecs(a)
    tokens = torch.randint(0, a.vocab_size, (1, 70), generator=torch.Generator().manual_seed(6))
    tiers = dict(window=8, sinks=2, block=16)
    dyn = MLANUQCache(a, 1, 80, codecs, mode="dynamic", **tiers)
    if fuse and os.environ.get("TRITON_INTERPRET") != "1":  # set before Triton is imported, as .ci/run does
        pytest.skip("the fused step's kernels need TRITON_INTERPRET=1 on the CPU")
    eng = DecodeEngine(model, MLANUQCache(a, 1, 80, codecs, mode="static", use_kernel=False, **tiers), graphs=False,
                       fuse=fuse)
    assert eng.mla_kernel == fuse
    with torch.no_grad():
        want = [model(tokens[:, :10], dyn, 0)[0, -1]] + [model(tokens[:, t : t + 1], dyn, t)[0, -1]
                                                         for t in range(10, 70)]
        got = [eng.prefill(0, tokens[0, :10])]
        for t in range(10, 70):
            eng.tokens[:1] = tokens[0, t]
            got.append(eng.step(1)[0].clone())
    assert dyn.n_blocks == [3, 3] and eng.cache.n_blocks == [3]  # (70 - 2 - 8) // 16
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=2e-3, rtol=1e-3)
    # the rotation folded into the model's absorbed weights: with everything in the fp16 window, the latent cache
    # gives the fp16 latent cache's logits (the rotation changes only the fp16 rounding of the rows)
    from moec.runtime.mla import MLACache

    wide = MLANUQCache(a, 1, 80, codecs, mode="dynamic", window=80, sinks=2, block=16)
    plain = MLACache(a, 1, 80)
    with torch.no_grad():
        for cache in (wide, plain):
            cache.logits = torch.cat([model(tokens[:, :10], cache, 0)] + [model(tokens[:, t : t + 1], cache, t)
                                                                          for t in range(10, 70)], 1)
    assert wide.n_blocks == [0, 0]
    torch.testing.assert_close(wide.logits, plain.logits, atol=2e-3, rtol=1e-3)


def test_bits_at_deepseek_dimensions():
    """DeepSeek-V2-Lite's latent (512 + 64): 148 bytes per history row (2.06 bits), 2.12 bits at 32k with the
    fp16 sinks and window of kv-mla-nuq2 (the issue's bound: 2.5)."""
    a = PRESETS["deepseek-v2-lite"]
    one = _codecs(dataclasses.replace(a, n_layers=1, ffn_kinds=[]))
    cache = MLANUQCache(a, 1, 64, one * a.n_layers, mode="dynamic")
    assert cache.history_bytes_per_token() == a.n_layers * 148
    assert abs(cache.bits_at(32768) - (32608 * 148 * 8 / 576 + 160 * 16) / 32768) < 1e-9  # 1019 blocks, 160 fp16
    assert cache.bits_at(32768) < 2.15


def test_refusals():
    """A per-head KV codec on an MLA model, the latent codec on a per-head model, pre-RoPE keys on a partial-rotary
    model, and malformed calibration."""
    from moec.calibrate.recipe import load_recipe
    from moec.calibrate.run import check_kv_attention

    llama = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      max_seq_len=64)
    with pytest.raises(UserError, match="use kv codec mla-nuq"):
        check_kv_attention(ARGS, load_recipe("kv-nuq2-rot"))
    with pytest.raises(UserError, match="has per-head keys and values"):
        check_kv_attention(llama, load_recipe("kv-mla-nuq2"))
    check_kv_attention(ARGS, load_recipe("kv-mla-nuq2"))  # the match passes
    glm = PRESETS["glm-4.5-air"]  # RoPE on half of each head: keys cached before RoPE are refused
    with pytest.raises(UserError, match="caches keys before RoPE"):
        check_kv_attention(glm, load_recipe("kv-nuq3-outlier"))
    check_kv_attention(glm, load_recipe("kv-nuq2-rot"))
    with pytest.raises(FormatError, match="has no MLA attention"):
        build_codecs({}, {}, llama)
    t = random_tensors(ARGS, {}, torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(FormatError, match="c_levels must be 4 increasing"):
        build_codecs({}, {**t, "kv.layers.1.c_levels": torch.tensor([0.0, 0.0, 1.0, 2.0])}, ARGS)
    with pytest.raises(FormatError, match="rope_signs: entries other than"):
        build_codecs({}, {**t, "kv.layers.0.rope_signs": signs_for(16, 0).float() * 2}, ARGS)
    with pytest.raises(FormatError, match="kv.layers.1.c_signs is missing"):
        build_codecs({}, {k: v for k, v in t.items() if k != "kv.layers.1.c_signs"}, ARGS)


def test_pipeline_on_demo_mla(tmp_path):
    """calibrate → pack → eval --mode dec on the shipped demo-mla with the latent cache (window 32, so 4 of 6
    blocks are history at 192 tokens): fitted levels and signs stored, the history's bits, and ppl_dec within 3%
    of the fp16 latent."""
    from tests.cli.run import moec

    recipe = tmp_path / "mla.yaml"
    recipe.write_text(yaml.safe_dump({"name": "mla-w32", "kv": {"codec": "mla-nuq", "bits": 2, "window": 32}}))
    calib, packed, out = tmp_path / "calib", tmp_path / "packed", tmp_path / "eval.json"
    r = moec("calibrate", "demo-mla", "--recipe", recipe, "--data", "ptb", "--split", "train", "--samples", "4",
             "--seq-len", "256", "-o", calib)
    assert r.returncode == 0, r.stderr
    r = moec("pack", "demo-mla", calib, "-o", packed)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((packed / "moec.json").read_text())
    assert manifest["recipe"]["kv"]["codec"] == "mla-nuq" and "kv.layers.3.rope_levels" in manifest["kv"]["tensors"]
    r = moec("eval", packed, "--mode", "dec", "--max-windows", "8", "--seq-len", "192", "--baseline", "demo-mla",
             "--json", out)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(out.read_text())
    assert rec["kv_codec"] == "mla-nuq"
    assert 2.1 < rec["kv_bits_32k"] < 2.5, rec["kv_bits_32k"]  # demo-mla's 128 + 32: 44 bytes per history row
    assert abs(rec["delta_pct"]) < 3 and 0 < rec["kld"] < 0.1, rec  # 8 windows: 2 gave +4% from sampling noise
