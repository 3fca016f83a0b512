"""End-to-end codebook tuning (calibrate/tune.py): the held-back split, early stopping on the held-back
KL, fp3 scale tuning, the recipe options, and the out-of-domain (KJV) scoring of bench_expert_quality."""

import pytest
import torch
import torch.nn.functional as F

from moec.calibrate import hls
from moec.calibrate import tune as tune_mod
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.tune import holdout_split, tune_codebooks
from moec.errors import UserError
from moec.runtime.experts import dequantize
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.model import build_model
from tests.cli.run import moec

CODECS = {"w1": ("hls", 2), "w3": ("hls", 2), "w2": ("fp3", 3)}  # hls codebooks and fp3 scales


def test_holdout_split_deterministic_and_disjoint():
    fit, held = holdout_split(32, 0.25, seed=0)
    assert len(held) == 8 and len(fit) == 24
    assert sorted(fit.tolist() + held.tolist()) == list(range(32))  # disjoint, every sequence once
    again = holdout_split(32, 0.25, seed=0)
    assert torch.equal(fit, again[0]) and torch.equal(held, again[1])  # seeded: the same split every run
    assert not torch.equal(held, holdout_split(32, 0.25, seed=1)[1])
    assert held.tolist() != list(range(24, 32))  # drawn, not the tail
    assert len(holdout_split(32, 0.0, 0)[1]) == 0 and len(holdout_split(3, 0.1, 0)[1]) == 1  # at least one
    with pytest.raises(UserError, match="leaves none to tune on"):
        holdout_split(1, 0.25, 0)


def _fitted(tiny_moe_dir):
    """The tiny model's source state and a plain fit (no Hessian) of its experts under CODECS. Expert
    weights × 10: at their random init (std 0.02) 2-bit experts cost a KL of 1e-5, too little to tune."""
    ck = HFCheckpoint(tiny_moe_dir)
    state = {k: v.float() * (10 if k.endswith(("moe.w1", "moe.w2", "moe.w3")) else 1)
             for k, v in ck.state_dict().items()}
    fitted, codecs = {}, {}
    for name in [n for n in state if n.endswith(("moe.w1", "moe.w2", "moe.w3"))]:
        codec, bits = CODECS[name[-2:]]
        codecs[name] = (codec, bits)
        stored = hls.quantize(state[name].float(), None, codec, bits, 0, gptq=False)
        fitted.update({f"fit.{name}.{p}": t for p, t in stored.items()})
    return ck.args, state, fitted, codecs


def _kl(args, state, fitted, codecs, tokens):
    """Mean per-token KL(source || model with the fitted weights) over tokens [n, L], from the stored parts."""
    q = dict(state)
    for name, (codec, bits) in codecs.items():
        parts = {k.removeprefix(f"fit.{name}."): v for k, v in fitted.items() if k.startswith(f"fit.{name}.")}
        q[name] = dequantize(codec, bits, tuple(state[name].shape), parts)
    f32 = {k: v.float() for k, v in state.items()}
    with torch.no_grad():
        p = torch.log_softmax(build_model(args, f32)(tokens).float(), -1)
        lq = torch.log_softmax(build_model(args, {k: v.float() for k, v in q.items()})(tokens).float(), -1)
    return F.kl_div(lq, p, log_target=True, reduction="none").sum(-1).mean().item()


class _Scripted(torch.optim.Optimizer):
    """Three small descent steps, then steps that only make things worse (a synthetic overfit)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.n = 0
        self.gen = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def step(self):
        self.n += 1
        for group in self.param_groups:
            for p in group["params"]:
                if self.n <= 3:  # sign descent: every entry moves 1.5% of its group's range (> int8 steps)
                    p -= 0.015 * p.grad.sign()
                else:
                    p += 0.3 * torch.randn(p.shape, generator=self.gen)


def test_early_stopping_keeps_the_best_held_back_state(tiny_moe_dir, monkeypatch):
    """Every calibration sequence is the same, so the held-back KL is the fit KL: the scripted optimizer
    lowers it for 3 steps, then raises it; tuning stops after `patience` worse evaluations and stores the
    state of step 3, whose KL (recomputed from the stored parts) is the reported best."""
    args, state, fitted, codecs = _fitted(tiny_moe_dir)
    tokens = torch.randint(0, args.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).expand(8, 32)
    kl_fit = _kl(args, state, fitted, codecs, tokens[:1])
    monkeypatch.setattr(tune_mod.torch.optim, "Adam", _Scripted)
    rep = tune_codebooks(args, state, fitted, codecs, tokens, steps=50, lr=1.0, batch=2, seed=0, holdout=0.25,
                         eval_every=1, patience=2)
    hist = dict(rep["kl_holdout_history"])
    assert rep["best_step"] == 3 and rep["steps_run"] == 5 and rep["stopped_early"], rep
    assert hist[0] > hist[1] > hist[2] > hist[3] and min(hist[4], hist[5]) > hist[3], hist
    assert rep["kl_holdout_first"] == pytest.approx(kl_fit, rel=1e-4)
    kl_tuned = _kl(args, state, fitted, codecs, tokens[:1])
    # the stored parts are the step-3 state up to their int8 / fp16 rounding, and the report says what they cost
    assert kl_tuned == pytest.approx(rep["kl_holdout_stored"], rel=1e-4)
    assert kl_tuned == pytest.approx(rep["kl_holdout_best"], rel=0.05) and kl_tuned < hist[2]
    assert len(rep["holdout_sequences"]) == 2 and rep["fit_sequences"] == 6


def test_no_improvement_keeps_the_fit_exactly(tiny_moe_dir):
    """Adam at a learning rate that only hurts: the held-back best is the untuned fit (step 0), stored
    bit for bit (hls int8 entries and fp16 scales, fp3 scales)."""
    args, state, fitted, codecs = _fitted(tiny_moe_dir)
    before = dict(fitted)
    tokens = torch.randint(0, args.vocab_size, (6, 32), generator=torch.Generator().manual_seed(1))
    rep = tune_codebooks(args, state, fitted, codecs, tokens, steps=30, lr=5.0, batch=2, seed=0, holdout=0.34,
                         eval_every=2, patience=2)
    assert rep["best_step"] == 0 and rep["steps_run"] == 4 and rep["kl_holdout_best"] == rep["kl_holdout_first"]
    assert before.keys() == fitted.keys() and all(torch.equal(before[k], fitted[k]) for k in before)


def test_tuning_lowers_held_back_kl_and_tunes_fp3_scales(tiny_moe_dir):
    """Plain Adam with a held-back share: the kept state has a lower held-back KL than the fit, and the
    fp3 scales moved (only the scale: codes stay)."""
    args, state, fitted, codecs = _fitted(tiny_moe_dir)
    before = dict(fitted)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, args.vocab_size, (1, 32), generator=g).expand(6, 32).clone()
    tokens[:, 16:] = torch.randint(0, args.vocab_size, (6, 16), generator=g)  # shared prefix, varied tails
    rep = tune_codebooks(args, state, fitted, codecs, tokens, steps=10, lr=0.02, batch=2, seed=0, holdout=0.34,
                         eval_every=5)
    assert rep["kl_holdout_best"] < rep["kl_holdout_first"] and rep["best_step"] > 0, rep
    held = tokens[rep["holdout_sequences"]]
    assert _kl(args, state, fitted, codecs, held) < _kl(args, state, before, codecs, held)
    w2 = "fit.layers.0.moe.w2"
    assert not torch.equal(fitted[f"{w2}.scale"], before[f"{w2}.scale"])
    assert torch.equal(fitted[f"{w2}.codes"], before[f"{w2}.codes"]) and fitted[f"{w2}.scale"].dtype == torch.float16


@pytest.mark.parametrize("cal,message", [
    ({"tune_steps": 10, "tune_holdout": 1.0}, "tune_holdout is the share"),
    ({"tune_steps": 10, "tune_holdout": -0.1}, "tune_holdout is the share"),
    ({"tune_steps": 10, "tune_patience": 3}, "set tune_holdout"),
    ({"tune_steps": 10, "tune_holdout": 0.25, "tune_lr_drops": 1}, "set tune_patience"),
    ({"tune_steps": 10, "tune_holdout": 0.25, "tune_eval_every": 0}, "tune_eval_every must be >= 1"),
    ({"tune_norms": True}, "set tune_steps"),
])
def test_bad_tune_options(cal, message):
    with pytest.raises(UserError, match=message):
        parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "bits": 2}], "calibration": cal})


def test_bad_holdout_is_a_one_line_error(tiny_moe_dir, tmp_path):
    """From the CLI: a bad fraction, and a held-back share that leaves no sequence to tune on (checked
    before any capture), exit 2 with one line."""
    for i, (holdout, samples, message) in enumerate([(1.5, 4, "tune_holdout is the share"),
                                                     (0.5, 1, "leaves none to tune on")]):
        recipe = tmp_path / f"r{i}.yaml"
        recipe.write_text(f"weights: [{{targets: [experts], codec: hls, bits: 2}}]\n"
                          f"calibration: {{tune_steps: 5, tune_holdout: {holdout}}}\n")
        r = moec("calibrate", tiny_moe_dir, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples",
                 samples, "--seq-len", "32", "-o", tmp_path / f"c{i}")
        assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
        last = r.stderr.strip().splitlines()[-1]  # after the "calibrating ..." log line
        assert "Traceback" not in r.stderr and last.startswith("moec: error: ") and message in last, r.stderr
        assert not (tmp_path / f"c{i}").exists()


def test_tuned_norm_gains_are_packed_in_place_of_the_source(tiny_moe_dir, tmp_path):
    """calibration.tune_norms: the norm gains are tuned with the codebooks (the held-back KL falls), and the pack
    stores them (fp32, marked tuned) where the source's were: the loaded model is the source
    with the dequantized experts and the tuned gains."""
    import json

    from safetensors.torch import load_file

    from moec.calibrate.pack import pack
    from moec.calibrate.run import calibrate
    from moec.runtime.loader import load_model

    args, state, fitted, codecs = _fitted(tiny_moe_dir)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, args.vocab_size, (1, 32), generator=g).expand(6, 32).clone()
    tokens[:, 16:] = torch.randint(0, args.vocab_size, (6, 16), generator=g)
    reps = {}
    for norms in (False, True):
        f = dict(fitted)
        reps[norms] = tune_codebooks(args, state, f, codecs, tokens, steps=10, lr=0.02, batch=2, seed=0,
                                     holdout=0.34, eval_every=5, norms=norms)
    assert reps[True]["norms"] == sorted(n for n in state if n.endswith("norm.weight")) and not reps[False]["norms"]
    assert reps[True]["kl_holdout_best"] < reps[True]["kl_holdout_first"], reps[True]

    recipe = parse_recipe({"name": "tn", "weights": [{"targets": ["experts"], "codec": "hls", "bits": 2}],
                           "calibration": {"tune_steps": 6, "tune_lr": 0.02, "tune_norms": True,
                                           "expert_policy": "all-experts-for-stats", "min_expert_tokens": 0}})
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    report = calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 4, 32, 0, calib)
    assert report["tune"]["norms"]
    tuned = {k.removeprefix("tuned."): v for k, v in load_file(str(calib / "calib.safetensors")).items()
             if k.startswith("tuned.")}
    assert set(tuned) == set(report["tune"]["norms"])
    src = HFCheckpoint(tiny_moe_dir).state_dict()
    assert any(not torch.equal(v, src[n].float()) for n, v in tuned.items())  # they moved
    pack(tiny_moe_dir, "tiny", calib, packed)
    entries = json.loads((packed / "moec.json").read_text())["tensors"]
    stored = {}
    for f in packed.glob("model-*.safetensors"):
        stored.update(load_file(str(f)))
    for n, v in tuned.items():
        assert entries[n]["tuned"] and entries[n]["dtype"] in ("float32", "F32") and torch.equal(stored[n], v)
    ref_state = dict(src) | tuned
    for n in [n for n in src if n.endswith(("moe.w1", "moe.w2", "moe.w3"))]:
        parts = {k.removeprefix(n + "."): v for k, v in stored.items() if k.startswith(n + ".")}
        ref_state[n] = dequantize("hls", 2, tuple(src[n].shape), parts)
    model, _ = load_model(packed)
    x = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        want = build_model(args, {k: v.float() for k, v in ref_state.items()})(x)
        torch.testing.assert_close(model(x).float(), want, rtol=1e-4, atol=1e-4)


def test_kjv_out_of_domain_scoring(tiny_moe_dir):
    """The out-of-domain scoring of benchmarks/bench_expert_quality.py on the tiny model: KJV test windows (the
    New Testament), scored against the base model's own logits (KL 0, top-1 1) and against a perturbed copy."""
    from moec.calibrate.data import eval_windows
    from moec.calibrate.sources import load_tokenizer
    from moec.runtime.perplexity import reference_logits, score_tf, windows_label

    tok = load_tokenizer(tiny_moe_dir)
    name, windows = eval_windows(tok, "kjv", 2, seq_len=64)
    assert name == "kjv/test" and windows.shape == (2, 64)
    assert tok.decode(windows[0, :12].tolist()).startswith("The book of the")  # Matthew 1:1
    ck = HFCheckpoint(tiny_moe_dir)
    base = build_model(ck.args, {k: v.float() for k, v in ck.state_dict().items()})
    base_logits = reference_logits(base, windows, 8)
    assert len(base_logits) == 2 and base_logits[0].shape == (64 - 8, ck.args.vocab_size)
    same = score_tf(base, windows, base_logits, 8)
    assert same["kld"] == pytest.approx(0, abs=1e-6) and same["top1"] == 1.0 and same["delta_pct"] == pytest.approx(0)
    assert same["scored_tokens"] == 2 * (64 - 8) and same["ppl"] > 1
    assert windows_label(*windows.shape, 8) == "2 windows (0-1) of 64, scored 8..63"
    noisy = {k: v.float() + (0.05 * torch.randn(v.shape) if k.endswith("moe.w2") else 0) for k, v in
             ck.state_dict().items()}
    r = score_tf(build_model(ck.args, noisy), windows, base_logits, 8)
    assert r["kld"] > 1e-4 and r["ppl_base"] == pytest.approx(same["ppl"])
