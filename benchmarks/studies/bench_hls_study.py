"""Weight-quantizer study by fake quantization in place: many methods, one set of statistics.

    OMP_NUM_THREADS=1 python3 -m benchmarks.studies.bench_hls_study --model smollm2-135m --scope mlp \
        --methods hls3:g64 rtn3:g64 hqq3:g64 fp3:g0 fp8 [--score-from 32] [--windows 8]

Scopes: `mlp` (gate/up/down of every block; the experts of a MoE model), `all` (attention q/k/v/o
and the MLP/experts), `down` (the down projections only, w2). Statistics are captured once, layer by
layer with the original weights (as `moec calibrate` does): H = XᵀX of the input of each targeted
matrix, per expert for MoE layers with the recipe's starved-expert policy (fit_experts.ExpertFitter).
Each method then quantizes every targeted matrix with the pure functions of moec/calibrate/hls.py
(HQQ through PyPI `hqq`), writes the dequantized weights into a copy of the model and is scored with
ppl_tf against the source model's logits (computed once). Its rows reproduce the calibrate → pack
path (same quantizers, same statistics; `moec calibrate` fits attention projections too, with the
same q/k/v and o Hessians as `capture` below).

Method spec: `<codec><bits>[:g<group>][:nogptq][:refit<N>][:noact][:had<B>][:L<n>]`, codec in hls, rtn, fp3, hqq,
fp8 (no bits), vq, tcq (moec/calibrate/tcq.py, the tcq codec's fit: `L` its state bits, default 12; `g` its
column block, default 64; gptq its block LDLQ; `w` its column-weighted block error; `la<N>` its lookahead, default
32; `kd<N>` its row scales tuned end to end). `had<B>`: incoherence processing (QuIP#, QuaRot; issue 17) simulated
exactly: each matrix is fitted in a rotated input basis, W' = W Rᵀ with H' = R H Rᵀ, R = blockdiag(Hadamard_B)·
diag(±1) / √B (B a power of two, capped at the largest one dividing the input dim; random signs seeded per matrix),
and W_hat = W'_hat R, which is what a kernel that rotates its input (or a neighbouring op that folds R in) would
compute.
Bits per weight are from the bytes of the stored parts (codes, codebooks, scales)
over the targeted matrices; HQQ: b + 32/g (its fp16 scale and zero per group).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moec.atomic import atomic_file
from moec.calibrate import hls, tcq, vq
from moec.calibrate.data import load_text, sample_windows
from moec.calibrate.fit_experts import ExpertFitter
from moec.calibrate.hessian import ExpertHessians, accumulate_hessian, regularize
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.rotation import block_hadamard
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.model import Block, build_model, rope_cos_sin
from moec.runtime.perplexity import make_windows, score_tf, windows_label

W = 1024
ATTN = ("wq", "wk", "wv", "wo")


def parse_method(spec: str) -> dict:
    head, *opts = spec.split(":")
    codec = head if head in ("fp3", "fp8") else head.rstrip("0123456789")
    m = {"spec": spec, "codec": codec, "bits": int(head[2:] if codec in ("fp3", "fp8") else head[len(codec):]),
         "group": 0, "gptq": True,
         "refit": 1, "act_order": True, "kd": 0, "had": 0, "dim": 0}
    for o in opts:
        if o.startswith("g"):
            m["group"] = int(o[1:])
        elif o == "nogptq":
            m["gptq"] = False
        elif o.startswith("refit"):
            m["refit"] = int(o[5:])
        elif o == "noact":
            m["act_order"] = False
        elif o.startswith("kd"):
            m["kd"] = int(o[2:])
        elif o.startswith("had"):
            m["had"] = int(o[3:])
        elif o.startswith("d") and o[1:].isdigit():
            m["dim"] = int(o[1:])
        elif o.startswith("L") and o[1:].isdigit():  # tcq: trellis state bits
            m["L"] = int(o[1:])
        elif o == "w":  # tcq: column-weighted block error
            m["weighted"] = True
        elif o.startswith("la") and o[2:].isdigit():  # tcq: lookahead columns of each block's path search
            m["lookahead"] = int(o[2:])
        else:
            raise SystemExit(f"unknown method option {o!r} in {spec!r}")
    return m


def targets(args, scope: str) -> list[str]:
    out = []
    for i in range(args.n_layers):
        if scope == "all":
            out += [f"layers.{i}.attn.{p}.weight" for p in ATTN]
        out += [f"layers.{i}.moe.{p}" for p in (("w2",) if scope == "down" else ("w1", "w3", "w2"))]
    return out


@torch.no_grad()
def capture(ck: HFCheckpoint, tokens: torch.Tensor, names: list[str], policy: str, min_tokens: int,
            batch: int = 8) -> tuple[dict, dict]:
    """{matrix name: H [E, I, I] (damped, positive definite)}, report of the starved-expert policy."""
    args = ck.args
    H: dict[str, torch.Tensor] = {}
    report: dict = {}
    fitter = ExpertFitter({}, ck.layer_state, policy, min_tokens)
    want_attn = any(".attn." in n for n in names)
    h = torch.nn.functional.embedding(tokens, ck.global_state()["tok_embeddings.weight"].float())
    cos, sin = rope_cos_sin(args, torch.arange(tokens.shape[1]), torch.float32)
    for i in range(args.n_layers):
        sd = {k.removeprefix(f"layers.{i}."): v.float() for k, v in ck.layer_state(i).items()}
        with torch.device("meta"):
            block = Block(args, i)
        block.load_state_dict(sd, strict=True, assign=True)
        got: dict = {}
        hess = ExpertHessians(args, {i}, ck.layer_state, lambda _l, s, got=got: got.update(s),
                              all_tokens=(policy == "all-experts-for-stats" and min_tokens > 0))
        D, Dh = args.dim, args.n_heads * args.head_dim
        Hq, Ho = torch.zeros(D, D), torch.zeros(Dh, Dh)
        hooks = []
        if want_attn:
            hooks.append(block.attn.wq.register_forward_pre_hook(
                lambda _m, a, Hq=Hq: accumulate_hessian(Hq, a[0].reshape(-1, a[0].shape[-1]))))
            hooks.append(block.attn.wo.register_forward_pre_hook(
                lambda _m, a, Ho=Ho: accumulate_hessian(Ho, a[0].reshape(-1, a[0].shape[-1]))))
        for s in range(0, h.shape[0], batch):
            h[s : s + batch] = block(h[s : s + batch], cos, sin, observer=hess)
        hess.flush()
        for hk in hooks:
            hk.remove()
        experts = got.get("experts", list(range(len(got["count"]))))
        H1, n1 = fitter._hessians(got, "H1", experts)
        H2, n2 = fitter._hessians(got, "H2", experts)
        report[i] = [{"tokens": a["tokens"], "w13": a["hessian"], "w2": b["hessian"]}
                     for a, b in zip(n1, n2, strict=True)]
        for n in names:
            if not n.startswith(f"layers.{i}."):
                continue
            p = n.split(".")[-1] if ".moe." in n else n.split(".")[-2]
            if p in ("w1", "w3"):
                H[n] = H1
            elif p == "w2":
                H[n] = H2
            elif p == "wo":
                H[n] = regularize(Ho)[0][None]
            else:
                H[n] = regularize(Hq)[0][None]
        del block, sd
        print(f"capture layer {i}", flush=True)
    return H, report


def stored_bytes(stored: dict) -> int:
    return sum(t.numel() * t.element_size() for t in stored.values())


def quantize_all(state: dict, H: dict, names: list[str], m: dict, kd_data=None) -> tuple[dict, float]:
    """(state with dequantized targets, bits per weight over the targets)."""
    new = dict(state)
    fitted = {}
    nbits = numel = 0
    for n in names:
        W0 = state[n].float()
        W3 = W0 if W0.dim() == 3 else W0[None]  # [E, O, I]
        Hn, R = H.get(n), None
        if m["had"]:  # fit in the rotated basis: W' = W Rᵀ, H' = R H Rᵀ (W' R x = W x)
            n_in = W3.shape[2]  # B, or the largest power of two dividing a smaller input dim
            R = block_hadamard(n_in, min(m["had"], n_in & -n_in), seed=names.index(n))
            W3 = W3 @ R.T
            Hn = None if Hn is None else R @ Hn @ R.T
        if m["codec"] == "hqq":
            from hqq.core.quantize import Quantizer

            E, O, I = W3.shape
            g = m["group"] or I
            q, meta = Quantizer.quantize(W3.reshape(E * O, I), nbits=m["bits"], channel_wise=True, group_size=g,
                                         optimize=True, round_zero=False, axis=1, device="cpu",
                                         compute_dtype=torch.float32)
            Wh = Quantizer.dequantize(q, meta).reshape(E, O, I).float()
            nbits += W3.numel() * (m["bits"] + 32 / g)
        elif m["codec"] == "tcq":  # the tcq codec's fit (moec/calibrate/tcq.py); g: its block-LDLQ step
            L = m.get("L", 12)
            states, scale = tcq.fit(W3, Hn if m["gptq"] else None, m["bits"], L, m["group"] or 64,
                                    lookahead=m.get("lookahead", tcq.LOOKAHEAD), weighted=m.get("weighted", False))
            Wh = tcq.code_table(L)[states] * scale[..., None]
            nbits += W3.numel() * m["bits"] + W3.shape[0] * W3.shape[1] * (16 + 32)  # + the lead word, fp16 scale
        elif m["codec"] == "vq":
            stored = vq.quantize_vq(W3, Hn, m["bits"], m["dim"] or 4, rounds=m["refit"])
            Wh = vq.fitted_weight(stored)
            nbits += W3.numel() * m["bits"] + 8 * (stored_bytes(stored) - stored_bytes({"c": stored["codes"]}))
        else:
            stored = hls.quantize(W3, Hn, m["codec"], m["bits"], m["group"], gptq=m["gptq"],
                                  refit_rounds=m["refit"], act_order=m["act_order"])
            Wh = hls.dequantize(m["codec"], m["bits"], tuple(W3.shape), stored)
            nbits += 8 * stored_bytes(stored)
            fitted[n] = stored
        assert torch.isfinite(Wh).all(), n
        if R is not None:
            Wh = Wh @ R  # back to the original basis
        numel += W3.numel()
        new[n] = Wh.reshape(W0.shape)
    if m["kd"] and m["codec"] == "tcq":  # the trellis codes stay; each row's fp16 scale is tuned
        new.update(tune_row_scales(kd_data[0], state, {n: new[n] for n in names}, kd_data[1], m["kd"]))
    elif m["kd"]:
        assert m["codec"] == "hls" and not m["had"], "kd tunes hls codebooks in the original basis"
        new.update(tune_luts(kd_data[0], state, fitted, m, kd_data[1], m["kd"]))
    return new, nbits / numel


def tune_row_scales(args, state: dict, w_hat: dict, calib: torch.Tensor, steps: int, batch: int = 2,
                    lr: float = 5e-3) -> dict:
    """Each quantized row's scale tuned end to end (a factor exp(δ) per row; codes and rotations fixed: a row
    scale commutes with the input rotation) to minimize KL(source || quantized) on the calibration tokens, as
    tune_luts does for hls tables; the stored layout and bit count do not change (the fp16 scale absorbs it)."""
    delta = {n: torch.zeros(*w.shape[:-1], 1, requires_grad=True) for n, w in w_hat.items()}
    kd_tune(args, state, lambda: {n: w * torch.exp(delta[n]) for n, w in w_hat.items()}, list(delta.values()),
            calib, steps, batch, lr)
    with torch.no_grad():  # the factor rounded to fp16 (the rounding of the stored product is not modelled)
        return {n: w * torch.exp(delta[n]).half().float() for n, w in w_hat.items()}


def kd_tune(args, state: dict, params, tunables: list, calib: torch.Tensor, steps: int, batch: int,
            lr: float) -> None:
    """Adam on `tunables` for `steps` steps, minimizing KL(source || model with params()) on batches of the
    calibration tokens (one seeded draw per step): the loop tune_luts and tune_row_scales share."""
    from torch.func import functional_call

    teacher = build_model(args, state)
    student = build_model(args, dict(state))
    for p in list(teacher.parameters()) + list(student.parameters()):
        p.requires_grad_(False)
    opt = torch.optim.Adam(tunables, lr=lr)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        b = calib[torch.randint(0, calib.shape[0], (batch,), generator=g)]
        with torch.no_grad():
            tl = torch.log_softmax(teacher(b), -1)
        sl = torch.log_softmax(functional_call(student, params(), (b,)), -1)
        loss = (tl.exp() * (tl - sl)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"kd step {step} kl {loss.item():.4f}", flush=True)


def tune_luts(args, state: dict, fitted: dict, m: dict, calib: torch.Tensor, steps: int, batch: int = 2,
              lr: float = 5e-3) -> dict:
    """Codebook values tuned end to end (indices fixed) to minimize KL(source || quantized) on the
    calibration tokens, then stored again as int8 entries × fp16 scale; returns the dequantized
    targets. The stored layout and bit count do not change."""

    from moec.formats import bitpack

    lut0, idx, delta, shapes = {}, {}, {}, {}
    for n, st in fitted.items():
        W0 = state[n]
        E, O, I = (W0 if W0.dim() == 3 else W0[None]).shape
        lut0[n] = hls.lut_from_stored(m["codec"], m["bits"], st)  # [E, O, G, K]
        G = lut0[n].shape[2]
        idx[n] = bitpack.unpack(st["codes"], m["bits"], I).view(E, O, G, I // G)
        delta[n] = torch.zeros_like(lut0[n], requires_grad=True)
        shapes[n] = W0.shape
    rng = {n: lut0[n].abs().amax(-1, keepdim=True) for n in lut0}

    def luts():
        return {n: lut0[n] + rng[n] * delta[n] for n in lut0}

    kd_tune(args, state, lambda: {n: lut.gather(-1, idx[n]).reshape(shapes[n]) for n, lut in luts().items()},
            list(delta.values()), calib, steps, batch, lr)
    out = {}
    with torch.no_grad():
        for n, lut in luts().items():
            st = dict(fitted[n]) | hls.int8_codebook(lut)
            W0 = state[n]
            out[n] = hls.dequantize(m["codec"], m["bits"], tuple((W0 if W0.dim() == 3 else W0[None]).shape),
                                    st).reshape(W0.shape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scope", choices=("mlp", "all", "down"), default="mlp")
    ap.add_argument("--methods", nargs="+", required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--score-from", type=int, default=32)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--policy", default="all-experts-for-stats")
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hessians", type=Path, default=None,
                    help="cache of the captured statistics (all linear layers): loaded if present, else saved")
    a = ap.parse_args()
    methods = [parse_method(s) for s in a.methods]
    model_dir = resolve_model(a.model)
    ck = HFCheckpoint(model_dir)
    tok = load_tokenizer(model_dir)
    windows = make_windows(tokenize(tok, load_text("ptb", "test")), W, a.windows)
    out = a.out or Path(__file__).resolve().parents[1] / "results" / f"hls_study_{a.model}.json"
    state = {k: v.float() for k, v in ck.state_dict().items()}
    names = targets(ck.args, a.scope)
    need_h = any(m["codec"] in ("hls", "fp3", "vq", "tcq") for m in methods)
    t0 = time.time()
    H, policy_report = ({}, {})
    calib = None
    if need_h or any(m["kd"] for m in methods):
        calib = sample_windows(tokenize(tok, load_text("ptb", "train")), a.samples, a.seq_len, a.seed)
    if need_h and a.hessians is not None and a.hessians.is_file():
        H, policy_report = torch.load(a.hessians, weights_only=True)
    elif need_h:  # statistics of every linear layer, so one capture serves every scope
        H, policy_report = capture(ck, calib, targets(ck.args, "all"), a.policy, a.min_tokens)
        if a.hessians is not None:
            with atomic_file(a.hessians) as tmp:
                torch.save((H, policy_report), tmp)
    capture_s = time.time() - t0
    t0 = time.time()
    cache = Path(f"/tmp/hls-study-base-{a.model}-w{a.windows}.pt")
    if cache.is_file():
        full = torch.load(cache, weights_only=True)
    else:  # logits at every position (scored slices differ between rows), computed once
        base = build_model(ck.args, state)
        with torch.no_grad():
            full = [base(windows[b : b + 1])[0, : W - 1] for b in range(windows.shape[0])]
        del base
        with atomic_file(cache) as tmp:
            torch.save(full, tmp)
    base_logits = [x[a.score_from - 1 :] for x in full]
    base_s = time.time() - t0
    print(f"base eval {base_s:.0f}s, capture {capture_s:.0f}s", flush=True)
    for m in methods:
        t0 = time.time()
        qstate, bits = quantize_all(state, H, names, m, (ck.args, calib))
        fit_s = time.time() - t0
        t0 = time.time()
        r = score_tf(build_model(ck.args, qstate), windows, base_logits, a.score_from)
        eval_s = time.time() - t0
        rec = base_record("hls-study", "cpu") | {
            "model": a.model, "scope": a.scope, "method": m["spec"], "codec": m["codec"], "bits": m["bits"],
            "group_size": m["group"], "gptq": m["gptq"] and m["codec"] in ("hls", "fp3", "vq", "tcq"),
            "trellis_bits": m.get("L") if m["codec"] == "tcq" else None,
            "vector_dim": m["dim"] or None,
            "refit_rounds": m["refit"],
            "kd_steps": m["kd"], "hadamard_block": m["had"],
            "act_order": m["act_order"], "q_bits": bits, "q_bits_note": "stored bytes of codes+codebooks+scales"
            if m["codec"] != "hqq" else "b + 32/g (fp16 scale, zero)",
            "context": W, "batch": 1, "mode": "tf", "dtype": "fp32", "data": "ptb/test",
            "windows": windows_label(windows.shape[0], W, a.score_from),
            "ppl": r["ppl"], "ppl_base": r["ppl_base"], "delta_pct": r["delta_pct"], "kld": r["kld"],
            "top1": r["top1"], "kv_bits": 16.0, "path": "fake-quant in place (torch reference)",
            "calibration": {"data": "ptb/train", "samples": a.samples, "seq_len": a.seq_len, "policy": a.policy,
                            "min_expert_tokens": a.min_tokens, "capture_seconds": round(capture_s, 1),
                            "policy_report": policy_report if ck.args.is_moe else None},
            "fit_seconds": round(fit_s, 1), "eval_seconds": round(eval_s, 1),
            "omp_threads": torch.get_num_threads(),
        }
        print(json.dumps({k: rec[k] for k in ("scope", "method", "q_bits", "ppl", "delta_pct", "kld", "top1",
                                              "fit_seconds", "eval_seconds")}), flush=True)
        records = json.loads(out.read_text()) if out.is_file() else []
        key = (a.model, a.scope, m["spec"], a.score_from, a.policy, a.samples, a.min_tokens)
        records = [x for x in records if (x["model"], x["scope"], x["method"], int(x["windows"].split("scored ")[1]
                   .split("..")[0]), x["calibration"]["policy"], x["calibration"]["samples"],
                   x["calibration"]["min_expert_tokens"]) != key] + [rec]
        write_json_atomic(out, records)


if __name__ == "__main__":
    main()
