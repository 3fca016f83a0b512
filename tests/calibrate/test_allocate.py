"""Bit allocation at a fixed budget (calibrate/allocate.py, recipe `allocate:`): the solver meets the budget
and is optimal where brute force can check it, impossible budgets are refused before fitting (CLI exit 2,
one line), and a tiny MoE calibrated with mixed widths packs, loads and decodes as its fitted parts say, on
the torch path and the Triton kernels (interpreter on the CPU)."""

import itertools
import json
import os
import random

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from moec.calibrate.allocate import Option, allocate, choose  # noqa: E402
from moec.calibrate.pack import pack  # noqa: E402
from moec.calibrate.recipe import parse_recipe  # noqa: E402
from moec.calibrate.run import calibrate  # noqa: E402
from moec.errors import UserError  # noqa: E402
from moec.rotation import rotate, unpack_signs  # noqa: E402
from moec.runtime.backend import kernels_forced  # noqa: E402
from moec.runtime.experts import dequantize  # noqa: E402
from moec.runtime.hf_layout import HFCheckpoint  # noqa: E402
from moec.runtime.loader import load_model  # noqa: E402
from moec.runtime.model import build_model  # noqa: E402
from tests.cli.run import moec  # noqa: E402


@pytest.mark.parametrize("seed", range(6))
def test_choose_is_the_brute_force_optimum(seed):
    rnd = random.Random(seed)
    units = [[Option(b, rnd.randint(10, 40) * b, rnd.random() * 2.0 ** -b) for b in (2, 3, 4)] for _ in range(6)]
    lo, hi = sum(min(o.nbytes for o in u) for u in units), sum(max(o.nbytes for o in u) for u in units)
    for budget in (lo, (2 * lo + hi) // 3, (lo + 2 * hi) // 3, hi):
        picks = choose(units, budget)
        assert sum(units[u][k].nbytes for u, k in enumerate(picks)) <= budget
        best = min(sum(units[u][k].error for u, k in enumerate(c)) for c in itertools.product(range(3), repeat=6)
                   if sum(units[u][k].nbytes for u, k in enumerate(c)) <= budget)
        assert sum(units[u][k].error for u, k in enumerate(picks)) == pytest.approx(best, rel=1e-12)


def test_coarse_resolution_still_meets_the_budget():
    rnd = random.Random(9)
    units = [[Option(b, rnd.randint(1000, 5000) * b, rnd.random() / b) for b in (2, 3, 4)] for _ in range(40)]
    budget = sum(u[1].nbytes for u in units)
    for res in (1, 7, 300):
        picks = choose(units, budget, res)
        assert sum(units[u][k].nbytes for u, k in enumerate(picks)) <= budget


def _cands(errors: dict[str, dict[int, float]], energy: dict[str, float]):
    return {p: {b: {"nbytes": 50 * b, "numel": 400, "output_error": e, "output_energy": energy[p]}
                for b, e in errs.items()} for p, errs in errors.items()}


def test_allocate_units_and_sensitivities():
    # error ∝ 4^-bits × a scale that grows with depth and is twice as large for w2
    errs = {f"layers.{i}.moe.{p}": {b: 4.0 ** (4 - b) * (i + 1) * (1 + (p == "w2")) for b in (2, 3, 4)}
            for i in range(3) for p in ("w1", "w3", "w2")}
    energy = {p: 100.0 * (int(p.split(".")[1]) + 1) ** 2 for p in errs}
    a = allocate(_cands(errs, energy), 3.0, "matrix", "output")
    assert a["q_bits"] <= 3.0 and set(a["choice"]) == set(errs)
    assert a["choice"]["layers.2.moe.w2"] > a["choice"]["layers.0.moe.w1"]  # the largest errors get the bits
    r = allocate(_cands(errs, energy), 3.0, "matrix", "relative")
    assert r["choice"] != a["choice"] and r["q_bits"] <= 3.0  # depth-normalized: layer 0 now weighs most
    assert r["choice"]["layers.0.moe.w2"] >= r["choice"]["layers.2.moe.w2"]
    u = allocate(_cands(errs, energy), 3.0, "layer", "output")
    for i in range(3):
        assert len({u["choice"][f"layers.{i}.moe.{p}"] for p in ("w1", "w3", "w2")}) == 1
    assert u["q_bits"] <= 3.0
    gu = allocate(_cands(errs, energy), 3.0, "gate_up", "output")
    assert all(gu["choice"][f"layers.{i}.moe.w1"] == gu["choice"][f"layers.{i}.moe.w3"] for i in range(3))
    assert gu["q_bits"] <= 3.0 and any(gu["choice"][f"layers.{i}.moe.w2"] != gu["choice"][f"layers.{i}.moe.w1"]
                                       for i in range(3))  # w2 (twice the error here) gets its own width


def test_gate_up_across_codecs_keeps_one_codec_per_block():
    """Candidates of two codecs (keys a2, a3, b2, b3; b cheaper and better on w2 here): unit gate_up gives w1 and w3
    one candidate and w2 one of the same codec, and among such choices it is the brute-force optimum."""
    rnd = random.Random(3)
    codec_of = {"a2": "a", "a3": "a", "b2": "b", "b3": "b"}
    params = [f"layers.{i}.moe.{p}" for i in range(2) for p in ("w1", "w3", "w2")]
    cands = {p: {k: {"nbytes": (40 if k.endswith("2") else 60) - (5 if k[0] == "b" else 0), "numel": 200,
                     "output_error": rnd.random() * (0.3 if k[0] == "b" and p.endswith("w2") else 1.0)
                     * (4.0 if k.endswith("2") else 1.0), "output_energy": 1.0} for k in codec_of} for p in params}
    for budget in (1.7, 2.0, 2.3):
        got = allocate(cands, budget, "gate_up", "output", codec_of=codec_of)
        c = got["choice"]
        assert got["q_bits"] <= budget
        best = float("inf")
        for picks in itertools.product(codec_of, repeat=4):  # (w1/w3, w2) of layers 0 and 1
            ch = {f"layers.{i}.moe.{p}": picks[2 * i + (p == "w2")] for i in range(2) for p in ("w1", "w3", "w2")}
            if any(codec_of[ch[f"layers.{i}.moe.w1"]] != codec_of[ch[f"layers.{i}.moe.w2"]] for i in range(2)):
                continue
            if 8.0 * sum(cands[p][k]["nbytes"] for p, k in ch.items()) / 1200 <= budget:
                best = min(best, sum(cands[p][k]["output_error"] for p, k in ch.items()))
        for i in range(2):
            assert c[f"layers.{i}.moe.w1"] == c[f"layers.{i}.moe.w3"]
            assert codec_of[c[f"layers.{i}.moe.w1"]] == codec_of[c[f"layers.{i}.moe.w2"]]
        assert got["error"] == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("alloc,message", [
    ({"budget": 3, "bits": [2, 2]}, "allocate.bits must list distinct"),
    ({"budget": 3, "bits": [2, 8]}, "allocate.bits [8] not taken by codec 'hls'"),
    ({"budget": 3, "bits": [2, 3], "sensitivity": "kl"}, "sensitivity"),
])
def test_bad_allocate_config(alloc, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "allocate": alloc}]})
    with pytest.raises(UserError, match="give the candidate widths in allocate.bits"):
        parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "bits": 2,
                                   "allocate": {"budget": 3, "bits": [2, 3]}}]})


def test_impossible_budget_exits_2_before_fitting(tiny_moe_dir, tmp_path):
    rec = tmp_path / "bad.yaml"
    rec.write_text(yaml.safe_dump({"weights": [{"targets": ["experts"], "codec": "hls", "group_size": 0,
                                                "allocate": {"budget": 2.5, "bits": [2, 3]}}]}))
    out = tmp_path / "calib"
    r = moec("calibrate", tiny_moe_dir, "--recipe", rec, "--data", "ptb", "--split", "valid", "--samples", "2",
             "--seq-len", "32", "-o", out)
    # tiny rows are short (48 and 40 inputs): a 4-entry int8 codebook + fp16 scale per row is ~1 bit more
    assert r.returncode == 2 and "allocate.budget 2.5 q_bits cannot be met by bits [2, 3]" in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if "error" in x]
    assert len(errors) == 1 and "achievable 3.0667 (all 2-bit) to 4.7778 (all 3-bit)" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "calibrating" not in r.stdout + r.stderr.split("error")[1]
    assert not out.exists()


def _q_bits(report, model_dir) -> float:
    """q_bits over every allocate rule's matrices, from the report's per-matrix q_bits."""
    shapes = {k: v.shape.numel() for k, v in HFCheckpoint(model_dir).state_dict().items()}
    per = {n: q for a in report["allocation"] for n, q in a["q_bits_per_matrix"].items()}
    return sum(q * shapes[n] for n, q in per.items()) / sum(shapes[n] for n in per)


def _assert_packed_is_source(packed, src):
    """The packed model computes the source model whose matrices are `src` (the stored parts dequantized)."""
    model, _ = load_model(packed)
    ref = build_model(model.args, src, dtype=torch.float32)
    x = torch.randint(0, model.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    return model


def _fused_and_per_expert(ew, dim, ids):
    """(the fused Triton kernels' output or None, the per-expert torch reference) for two tokens routed to `ids`."""
    h = torch.randn(2, dim)
    ids = torch.tensor(ids)
    wts = torch.softmax(torch.randn(2, 2), -1)
    with kernels_forced("1"):
        fused = ew.fused(h, wts, ids)
    want = sum(wts[:, a, None] * torch.stack([ew.expert(int(ids[n, a]), h[n : n + 1])[0] for n in range(2)])
               for a in range(2))
    return fused, want


def _stored(packed):
    out = {}
    for f in packed.glob("model-*.safetensors"):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("unit", ["matrix", "layer"])
def test_mixed_widths_pipeline(tiny_moe_dir, tmp_path, unit):
    """calibrate → pack → load with allocate on experts (incoherence on): the widths differ between matrices,
    the budget holds in the packed q_bits, each stored matrix decodes at its own width (torch path: the model
    equals the source with W = dequant(parts)·Rᵀ), and the fused Triton kernels agree where a layer is
    of one width (unit: layer)."""
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    rule = {"targets": ["experts"], "codec": "hls", "group_size": 0, "incoherence": {},
            "allocate": {"budget": 4.6, "bits": [2, 3, 4], "unit": unit, "keep_candidates": True}}
    attn = {"targets": ["attention"], "codec": "hls", "group_size": 0,  # QLinear: one width per projection
            "allocate": {"budget": 4.6, "bits": [2, 3, 4]}}
    recipe = parse_recipe({"name": "alloc", "weights": [rule] + ([attn] if unit == "matrix" else []),
                           "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0}})
    report = calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, calib)
    alloc = report["allocation"][0]
    bits = alloc["bits"]
    assert len(bits) == 6 and len(set(bits.values())) > 1, bits  # mixed widths
    assert alloc["q_bits"] <= 4.6
    fitted = load_file(str(calib / "calib.safetensors"))
    for n, b in bits.items():  # the chosen candidate is the stored fit; the others are kept (keep_candidates)
        assert torch.equal(fitted[f"fit.{n}.codes"], fitted[f"cand.{b}.fit.{n}.codes"])
        assert fitted[f"fit.{n}.codebook"].shape[-1] == 2**b
        layer = report["layers"][int(n.split(".")[1])]["weights"][n.rsplit(".", 1)[-1]]
        assert layer["bits"] == b and set(layer["candidates"]) == {"2", "3", "4"}
        errs = [sum(layer["candidates"][str(w)]["output_error"]) for w in (2, 3, 4)]
        assert errs[0] > errs[1] > errs[2] > 0, errs
    if unit == "layer":
        for i in (0, 1):
            assert len({bits[f"layers.{i}.moe.{p}"] for p in ("w1", "w2", "w3")}) == 1
    man = pack(tiny_moe_dir, "tiny", calib, packed)
    want = _q_bits(report, tiny_moe_dir)
    assert man["effective_bits"]["q_bits"] == pytest.approx(want, abs=1e-5) and want <= 4.6
    assert man["calibration"]["allocation"][0]["bits"] == bits
    stored, tensors = _stored(packed), json.loads((packed / "moec.json").read_text())["tensors"]
    src = HFCheckpoint(tiny_moe_dir).state_dict()
    for n, b in {n: b for a in report["allocation"] for n, b in a["bits"].items()}.items():
        assert tensors[f"{n}.codes"]["bits"] == b
        parts = {k.removeprefix(n + "."): v for k, v in stored.items() if k.startswith(n + ".")}
        if src[n].dim() == 2:  # attention: stored without the E axis, no rotation here
            parts = {k: v[None] for k, v in parts.items()}
            src[n] = dequantize("hls", b, (1, *src[n].shape), parts)[0]
            continue
        assert tensors[f"{n}.had_signs"]["bits"] == b
        signs = unpack_signs(parts.pop("had_signs"), src[n].shape[-1])
        src[n] = rotate(dequantize("hls", b, tuple(src[n].shape), parts), signs, inverse=True)
    model = _assert_packed_is_source(packed, src)
    # the Triton kernels: w1 and w3 of one width fuse (w2 may differ); otherwise the torch path
    for i in (0, 1):
        fused, want = _fused_and_per_expert(model.layers[i].moe.codec, model.args.dim, [[0, 3], [2, 4]])
        if bits[f"layers.{i}.moe.w1"] != bits[f"layers.{i}.moe.w3"]:  # one gate/up launch reads both
            assert fused is None
            continue
        torch.testing.assert_close(fused.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    json.dumps(report)  # the report (allocation included) is plain JSON
    if unit == "matrix":  # attention projections of mixed widths: the qlinear kernel per QLinear
        abits = report["allocation"][1]["bits"]
        assert len(abits) == 8 and len(set(abits.values())) > 1, abits
        h = torch.randn(3, model.args.dim)
        for n, b in abits.items():
            i, proj = int(n.split(".")[1]), n.split(".")[3]
            lin = getattr(model.layers[i].attn, proj)
            assert lin.q.bits == b and tensors[f"{n}.codes"]["bits"] == b
            with kernels_forced("1"):
                got = lin(h)
            want = torch.nn.functional.linear(h, lin.q.dequant_ref(0))
            torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    # chosen again from the kept candidates at another budget, no refitting (benchmarks/bench_alloc.py)
    from moec.calibrate.reallocate import reallocate

    rep2, _ = reallocate(tiny_moe_dir, calib, tmp_path / "calib2", 3.5, "relative")
    a2 = rep2["allocation"][0]
    assert a2["q_bits"] <= 3.5 and a2["sensitivity"] == "relative" and a2["bits"] != bits
    t2 = load_file(str(tmp_path / "calib2" / "calib.safetensors"))
    assert not any(k.startswith("cand.") for k in t2)
    for n, b in a2["bits"].items():
        assert torch.equal(t2[f"fit.{n}.codes"], fitted[f"cand.{b}.fit.{n}.codes"])
    man2 = pack(tiny_moe_dir, "tiny", tmp_path / "calib2", tmp_path / "packed2")
    assert man2["effective_bits"]["q_bits"] == pytest.approx(_q_bits(rep2, tiny_moe_dir), abs=1e-5)
    assert man2["recipe"]["weights"][0]["allocate"]["budget"] == 3.5


def test_expert_parallel_merge_interleaves_candidates():
    """Two ranks' shares of one layer (experts 0, 2 and 1) under allocate: each width's per-expert lists and
    tensors interleave like the plain fit's."""
    from moec.calibrate.fit_experts import _merge

    codes = torch.arange(3 * 4).view(3, 4)

    def share(experts, errs):
        c = {"2": {"output_error": errs, "output_energy": [1.0] * len(errs), "rel_output_error": errs}}
        return ({"cand.2.fit.layers.0.moe.w2.codes": codes[experts]},
                {"entry": {"experts": [{"tokens": e} for e in experts],
                           "w2": {"rel_output_error": errs, "candidates": c}}, "experts": experts})

    tensors, merged = _merge([share([0, 2], [0.0, 0.2]), share([1], [0.1])], 3)
    assert torch.equal(tensors["cand.2.fit.layers.0.moe.w2.codes"], codes)
    assert merged["w2"]["candidates"]["2"]["output_error"] == [0.0, 0.1, 0.2]


@pytest.fixture(scope="module")
def tiny_moe32_dir(tmp_path_factory):
    """tiny_moe_dir with 64/32 inputs per matrix: whole 32-input chunks, as tcq's kernel rule asks."""
    from tests.conftest import make_tiny_mixtral

    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny-moe32"), hidden_size=64, intermediate_size=32,
                             num_attention_heads=4, num_local_experts=4)


@pytest.mark.parametrize("codec, group_size", [("tcq", 0), ("vq", 2)])
def test_allocate_takes_the_computed_and_vector_codecs(tiny_moe32_dir, tmp_path, codec, group_size):
    """allocate over tcq / vq widths: mixed widths within the budget, and the packed model decodes each matrix at
    its own width (the torch path equals the source with W = dequant(parts))."""
    from moec.calibrate.allocate import candidate_bytes

    src = HFCheckpoint(tiny_moe32_dir).state_dict()
    shapes = {n: tuple(t.shape) for n, t in src.items() if ".moe.w" in n}
    per = {b: sum(candidate_bytes(codec, b, s, group_size, 0) for s in shapes.values()) for b in (2, 3)}
    budget = 8.0 * (per[2] + per[3]) / 2 / sum(torch.Size(s).numel() for s in shapes.values())
    rule = {"targets": ["experts"], "codec": codec, "group_size": group_size, "allocate": {"budget": budget,
                                                                                          "bits": [2, 3]}}
    recipe = parse_recipe({"name": "alloc", "weights": [rule],
                           "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0}})
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    report = calibrate(tiny_moe32_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, calib)
    bits = report["allocation"][0]["bits"]
    assert len(bits) == len(shapes) and set(bits.values()) == {2, 3}, bits
    man = pack(tiny_moe32_dir, "tiny", calib, packed)
    assert man["effective_bits"]["q_bits"] == pytest.approx(_q_bits(report, tiny_moe32_dir), abs=1e-5)
    assert _q_bits(report, tiny_moe32_dir) <= budget + 1e-6  # (the report rounds per-matrix q_bits)
    stored, tensors = _stored(packed), json.loads((packed / "moec.json").read_text())["tensors"]
    for n, b in bits.items():
        assert tensors[f"{n}.codes"]["bits"] == b
        parts = {k.removeprefix(n + "."): v for k, v in stored.items() if k.startswith(n + ".")}
        src[n] = dequantize(codec, b, tuple(src[n].shape), parts)
    _assert_packed_is_source(packed, src)


def test_allocate_across_codecs(tiny_moe32_dir, tmp_path):
    """allocate.candidates of two codecs (tcq 2-bit, hls 3-bit) under unit gate_up, then tuning: each matrix tuned
    and stored under its chosen codec and width (manifest, parts), a layer's w1, w3 and w2 in one codec, the budget
    held, the torch path equal to the source with W = dequant(parts), and the fused kernels taking each layer."""
    from moec.calibrate.allocate import candidate_bytes

    src = HFCheckpoint(tiny_moe32_dir).state_dict()
    shapes = {n: tuple(t.shape) for n, t in src.items() if ".moe.w" in n}
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    lo = sum(candidate_bytes("tcq", 2, s, 0, 0) for s in shapes.values())
    hi = sum(candidate_bytes("hls", 3, s, 0, 0) for s in shapes.values())
    budget = 8.0 * (lo + hi) / 2 / numel
    rule = {"targets": ["experts"], "codec": "tcq", "allocate": {
        "budget": budget, "unit": "gate_up", "candidates": [{"bits": 2}, {"codec": "hls", "bits": 3}]}}
    recipe = parse_recipe({"name": "alloc-x", "weights": [rule],
                           "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0,
                                           "tune_steps": 2, "tune_batch": 2}})
    assert list(recipe.weights[0].candidate_rules()) == ["tcq2", "hls3"]
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    report = calibrate(tiny_moe32_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, calib)
    alloc = report["allocation"][0]
    choice = alloc["choice"]
    codec = {n: {"tcq2": "tcq", "hls3": "hls"}[k] for n, k in choice.items()}
    assert set(codec.values()) == {"tcq", "hls"}, choice  # both codecs chosen somewhere at this budget
    for i in (0, 1):
        assert len({codec[f"layers.{i}.moe.{p}"] for p in ("w1", "w3", "w2")}) == 1
    assert alloc["bits"] == {n: 2 if k == "tcq2" else 3 for n, k in choice.items()}
    assert sorted(report["tune"]["codecs"]) == ["hls", "tcq"]  # each matrix tuned as its chosen codec
    man = pack(tiny_moe32_dir, "tiny", calib, packed)
    assert man["effective_bits"]["q_bits"] == pytest.approx(_q_bits(report, tiny_moe32_dir), abs=1e-5)
    assert _q_bits(report, tiny_moe32_dir) <= budget + 1e-6
    stored, tensors = _stored(packed), json.loads((packed / "moec.json").read_text())["tensors"]
    for n, b in alloc["bits"].items():
        assert (tensors[f"{n}.codes"]["codec"], tensors[f"{n}.codes"]["bits"]) == (codec[n], b)
        parts = {k.removeprefix(n + "."): v for k, v in stored.items() if k.startswith(n + ".")}
        src[n] = dequantize(codec[n], b, tuple(src[n].shape), parts)
    model = _assert_packed_is_source(packed, src)
    for i in (0, 1):
        fused, want = _fused_and_per_expert(model.layers[i].moe.codec, model.args.dim, [[0, 3], [2, 1]])
        torch.testing.assert_close(fused.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("alloc,message", [
    ({"budget": 3, "bits": [2], "candidates": [{"bits": 2}, {"bits": 3}]}, "leave allocate.bits out"),
    ({"budget": 3, "candidates": [{"bits": 2}, {"bits": 2, "codec": "hls"}, {"bits": 2}]}, "lists hls2 twice"),
    ({"budget": 3, "candidates": [{"bits": 2}, {"bits": 16, "codec": "keep"}]}, "candidates[1]: codec 'keep'"),
    ({"budget": 3, "candidates": [{"bits": 2}, {"bits": 2, "codec": "vq", "group_size": 3}]}, "group_size must be"),
    ({"budget": 3, "candidates": [{"bits": 2, "shared_codebook": True}]}, "codec 'hls' has none to share"),
])
def test_bad_allocate_candidates(alloc, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "allocate": alloc}]})
