"""Train the built-in ``demo-moe`` model: a small Mixtral-architecture MoE.

Why: moec needs an MoE checkpoint with *trained* routing and expert statistics that is small
enough to commit (≤ 15 MiB in bf16) and to calibrate on a CPU in a minute or two. No hub
download is possible here, so the project trains its own from the corpus that
``scripts/build_demo_corpus.py`` writes (KJV + Python docs + PTB train; PTB test held out).

What it does:

* builds ``transformers.MixtralForCausalLM`` (8 experts, top-2, hidden 256, 4 layers, 8 heads,
  2 KV heads, head_dim 32, expert ffn 160, vocab 8192, tied embeddings, ≈ 6.7M parameters) with
  a Switch-style load-balancing loss (weight 0.01) applied per 1024-token window, so that every
  domain (and PTB in particular, the calibration text) spreads over all experts;
* trains it with AdamW and a warmup + cosine schedule in bf16 autocast: first at sequence length
  1024, then a short final phase at 2048 so it is usable at ≥ 2048 tokens of context. The run is
  sized to a wall-clock budget from the throughput measured on its first steps. PTB valid is
  evaluated periodically; if it stops improving, phase 1 ends early from the best weights;
* measures PTB valid/test perplexity (non-overlapping 1024-token windows, positions 32..1023
  scored), the add-one unigram perplexity of the training tokens on the same test tokens, and
  the per-layer expert load on PTB test;
* saves model (bf16 safetensors) + tokenizer (``PreTrainedTokenizerFast``) + ``train_report.json``
  into one folder, checks its size, reloads it with ``from_pretrained`` and checks that the test
  perplexity survives the round trip.

GPU run:   ``python3 scripts/train_demo_moe.py --data .demo_build --out OUT/demo-moe``
CPU smoke: ``python3 scripts/train_demo_moe.py --data .demo_build --out /tmp/demo-moe --steps 3 --device cpu``
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

LOG = logging.getLogger("train_demo_moe")

EOT = "<|endoftext|>"
SCORE_FROM = 32  # positions SCORE_FROM..window-1 of every eval window are scored
MAX_FOLDER_MIB = 15.0


# ----------------------------------------------------------------------------- model / data


def build_config(vocab_size: int, eot_id: int, args: argparse.Namespace) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=None,
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        router_jitter_noise=0.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=None,
        use_cache=True,
    )


def load_tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


def windows(tokens: np.ndarray, length: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping full windows of ``length`` tokens (the ragged tail is dropped)."""
    n = len(tokens) // length
    if limit is not None:
        n = min(n, limit)
    return torch.from_numpy(tokens[: n * length].astype(np.int64)).view(n, length)


class BatchSampler:
    """Random contiguous windows of the flat training array (seeded)."""

    def __init__(self, tokens: np.ndarray, device: torch.device, seed: int):
        self.data = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device = device

    def __call__(self, batch: int, seq: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.data) - seq, (batch,), generator=self.gen)
        idx = starts.to(self.device)[:, None] + torch.arange(seq, device=self.device)[None, :]
        return self.data[idx]


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, wins: torch.Tensor, device: torch.device, batch: int, autocast: bool,
             n_experts: int = 0) -> dict:
    """Mean NLL over positions SCORE_FROM..end of each window; optional expert load counts."""
    was_training = model.training
    model.eval()
    nll_sum, n_scored = 0.0, 0
    counts = None
    for i in range(0, len(wins), batch):
        x = wins[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=x, output_router_logits=n_experts > 0, use_cache=False)
        logits = out.logits[:, SCORE_FROM - 1:-1].float()
        tgt = x[:, SCORE_FROM:]
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), reduction="sum")
        nll_sum += nll.item()
        n_scored += tgt.numel()
        if n_experts:
            if counts is None:
                counts = torch.zeros(len(out.router_logits), n_experts, dtype=torch.long)
            k = model.config.num_experts_per_tok
            for layer, rl in enumerate(out.router_logits):
                top = rl.float().topk(k, dim=-1).indices.reshape(-1)
                counts[layer] += torch.bincount(top, minlength=n_experts).cpu()
    model.train(was_training)
    mean = nll_sum / n_scored
    res = {"nll": mean, "ppl": math.exp(mean), "scored_tokens": n_scored, "windows": len(wins)}
    if counts is not None:
        res["expert_counts"] = counts
    return res


def load_balance(counts: torch.Tensor) -> list[dict]:
    out = []
    for layer, c in enumerate(counts.tolist()):
        total = sum(c)
        frac = [x / total for x in c]
        out.append({"layer": layer, "fraction": [round(f, 5) for f in frac],
                    "min_max_ratio": round(min(frac) / max(frac), 4) if max(frac) > 0 else 0.0})
    return out


def unigram_ppl(train: np.ndarray, wins: torch.Tensor, vocab: int) -> float:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    scored = wins[:, SCORE_FROM:].reshape(-1).numpy()
    return float(math.exp(-logp[scored].mean()))


# ----------------------------------------------------------------------------- training


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


def make_optimizer(model, lr: float, wd: float, device: torch.device):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def sequence_balance_loss(router_logits, batch: int, top_k: int) -> torch.Tensor:
    """Switch-style load-balancing loss computed per sequence and per layer, then averaged.

    Same scale as transformers' ``load_balancing_loss_func`` (a balanced router gives
    ``top_k``), but that one pools all tokens of the batch (and all layers), which random
    mixed-domain batches satisfy with domain-specialised experts: PTB text then uses a few
    experts only. Balancing each 1024-token window makes every domain use every expert.
    """
    total = 0.0
    for rl in router_logits:
        n_exp = rl.size(-1)
        probs = rl.float().softmax(dim=-1).view(batch, -1, n_exp)  # (B, T, E)
        top = probs.topk(top_k, dim=-1).indices  # (B, T, k)
        frac = F.one_hot(top, n_exp).sum(dim=2).float().mean(dim=1)  # (B, E), sums to k
        total = total + n_exp * (frac * probs.mean(dim=1)).sum(dim=-1).mean()
    return total / len(router_logits)


def train_step(model, opt, x: torch.Tensor, lr: float, device: torch.device, clip: float,
               aux_coef: float, balance: str):
    """One AdamW step. Returns (LM loss, balance loss, grad norm) as detached tensors."""
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(input_ids=x, use_cache=False, output_router_logits=True)
    logits = out.logits[:, :-1].float()
    lm_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    if balance == "sequence":
        aux = sequence_balance_loss(out.router_logits, x.size(0), model.config.num_experts_per_tok)
    else:  # transformers' batch-pooled loss, as MixtralForCausalLM adds it with labels=
        aux = out.aux_loss
    (lm_loss + aux_coef * aux).backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return lm_loss.detach(), aux.detach(), gnorm.detach()


def check_experts_backend(model, batch: int, seq: int, vocab: int, device: torch.device) -> None:
    """One forward/backward on random tokens; fall back to the eager experts loop if the
    grouped_mm path fails here (it is not autocast-aware and sees fp32 master weights)."""
    x = torch.randint(0, vocab, (batch, seq), device=device)
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
    except (RuntimeError, NotImplementedError) as exc:
        LOG.warning("experts implementation %s failed (%s); using eager",
                    model.config._experts_implementation, exc)
        model.set_experts_implementation("eager")
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def cast_params_bf16(model) -> None:
    """Cast parameters to bf16 as saved, keeping fp32 buffers (RoPE inv_freq) as a reload has them."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to(torch.bfloat16)
    for name, b in buffers.items():
        prefix, _, attr = name.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        setattr(owner, attr, b)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(".demo_build"), help="build_demo_corpus output")
    ap.add_argument("--out", type=Path, required=True, help="output model folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=110.0,
                    help="training wall-clock budget, seconds (110 reproduces the shipped model)")
    ap.add_argument("--steps", type=int, default=None,
                    help="fixed total step count (skips budget sizing; for smoke tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step at seq 1024")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seq2", type=int, default=2048, help="sequence length of the final phase")
    ap.add_argument("--phase2-frac", type=float, default=0.1, help="share of the budget at seq2")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--balance", choices=("sequence", "batch"), default="sequence",
                    help="balance loss per 1024-token window (default) or pooled over the batch "
                         "(transformers' own)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=160)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--evals", type=int, default=20, help="PTB-valid evaluations during phase 1")
    ap.add_argument("--patience", type=int, default=4,
                    help="end phase 1 after this many evaluations without a valid improvement")
    ap.add_argument("--eval-windows", type=int, default=None, help="cap on eval windows (smoke tests)")
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--calib-steps", type=int, default=25, help="steps timed to size the run")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    t_start = time.time()

    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if args.batch is None:
        args.batch = 2 if cpu else 64
    if args.eval_windows is None and cpu:
        args.eval_windows = 2
    if cpu and args.steps is None:
        args.steps = 3
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # ---- data and tokenizer
    meta = json.loads((args.data / "corpus.json").read_text())
    eot_id = meta["eot_id"]
    train = load_tokens(args.data / meta["train"]["file"])
    valid = load_tokens(args.data / meta["ptb_valid"]["file"])
    test = load_tokens(args.data / meta["ptb_test"]["file"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(args.data / "tokenizer.json"),
        bos_token=EOT, eos_token=EOT, model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    vocab = len(tokenizer)
    assert vocab == meta["vocab_size"] and tokenizer.convert_tokens_to_ids(EOT) == eot_id
    LOG.info("data: train %d tokens, PTB valid %d, PTB test %d; vocab %d",
             len(train), len(valid), len(test), vocab)
    valid_w = windows(valid, args.seq, args.eval_windows)
    test_w = windows(test, args.seq, args.eval_windows)
    test_w2 = windows(test, args.seq2, args.eval_windows)

    # ---- model
    config = build_config(vocab, eot_id, args)
    model = MixtralForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    LOG.info("model: %d parameters (%.2fM), experts implementation %s, attention %s",
             n_params, n_params / 1e6, model.config._experts_implementation,
             model.config._attn_implementation)
    check_experts_backend(model, args.batch, args.seq, vocab, device)
    opt = make_optimizer(model, args.lr, args.wd, device)
    sampler = BatchSampler(train, device, args.seed)
    floor = args.lr * args.min_lr_frac
    batch2 = max(1, args.batch * args.seq // args.seq2)
    tok_step1, tok_step2 = args.batch * args.seq, batch2 * args.seq2

    history: list[dict] = []
    valid_history: list[dict] = []
    tokens_seen = 0
    train_time = 0.0  # seconds spent in training steps (evaluations excluded)

    def log_step(step: int, phase: int, lr: float, loss, aux, gnorm) -> None:
        rec = {"step": step, "phase": phase, "lr": lr, "loss": float(loss), "aux_loss": float(aux),
               "grad_norm": float(gnorm), "tokens": tokens_seen, "train_s": round(train_time, 2)}
        history.append(rec)
        LOG.info("step %d (phase %d) loss %.4f aux %.4f gnorm %.3f lr %.2e tokens %.1fM %.0fs",
                 step, phase, rec["loss"], rec["aux_loss"], rec["grad_norm"], lr,
                 tokens_seen / 1e6, train_time)

    # ---- phase 1, with throughput calibration on its first steps
    tps_calib = None
    if args.steps is not None:
        steps2 = max(1, round(args.steps * args.phase2_frac)) if args.steps > 1 else 0
        steps1 = args.steps - steps2
    else:
        steps1, steps2 = None, None
    warmup = min(args.warmup, max(1, (steps1 or 10**9) // 10))
    step = 0
    calib_t0 = None
    best = {"nll": float("inf"), "step": -1, "state": None}
    bad_evals = 0
    stopped_early = False
    eval_every = max(1, (steps1 or 10**9) // args.evals)
    while steps1 is None or step < steps1:
        # one warmup + cosine curve over both phases (phase 2 follows it linearly, below)
        total_for_lr = steps1 + steps2 if steps1 is not None else 10**9
        lr = lr_at(step, total_for_lr, warmup, args.lr, floor)
        x = sampler(args.batch, args.seq)
        sync(device)
        t0 = time.time()
        loss, aux, gnorm = train_step(model, opt, x, lr, device, args.clip,
                                       args.aux_coef, args.balance)
        sync(device)
        train_time += time.time() - t0
        tokens_seen += tok_step1
        step += 1
        if step == 5:
            calib_t0 = (train_time, step)
        if steps1 is None and step == args.calib_steps:
            dt = train_time - calib_t0[0]
            tps_calib = (step - calib_t0[1]) * tok_step1 / dt
            total_tokens = tps_calib * args.budget
            steps1 = int(total_tokens * (1 - args.phase2_frac) / tok_step1)
            # the 2048 phase is assumed 10% slower per token (attention grows with length)
            steps2 = max(1, int(total_tokens * args.phase2_frac * 0.9 / tok_step2))
            warmup = min(args.warmup, steps1 // 10)
            eval_every = max(1, steps1 // args.evals)
            LOG.info("throughput %.0f tokens/s -> plan: %d steps at seq %d (%d tokens/step) + %d "
                     "steps at seq %d; warmup %d; eval every %d steps",
                     tps_calib, steps1, args.seq, tok_step1, steps2, args.seq2, warmup, eval_every)
        if step % 50 == 0 or step <= 3 or step == steps1:
            log_step(step, 1, lr, loss, aux, gnorm)
        if not math.isfinite(float(loss)):
            raise RuntimeError(f"non-finite loss at step {step}")
        if steps1 is not None and (step % eval_every == 0 or step == steps1):
            ev = evaluate(model, valid_w, device, args.eval_batch, autocast=True)
            valid_history.append({"step": step, "tokens": tokens_seen, "nll": ev["nll"], "ppl": ev["ppl"]})
            LOG.info("eval step %d: PTB valid ppl %.2f (best %.2f)", step, ev["ppl"],
                     math.exp(best["nll"]) if best["state"] is not None else float("nan"))
            if ev["nll"] < best["nll"]:
                best = {"nll": ev["nll"], "step": step, "lr": lr,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                bad_evals = 0
            else:
                bad_evals += 1
                if bad_evals >= args.patience and step < steps1:
                    LOG.warning("PTB valid stopped improving: ending phase 1 at step %d, "
                                "restoring step %d", step, best["step"])
                    stopped_early = True
                    break
        if steps1 is not None and args.steps is None and \
                train_time > 1.1 * args.budget * (1 - args.phase2_frac):
            LOG.warning("phase 1 over its time budget: stopping at step %d of %d", step, steps1)
            break
    phase1_steps = step
    lr2_start = lr_at(step, steps1 + steps2, warmup, args.lr, floor)
    if best["state"] is not None and best["step"] != step:
        model.load_state_dict(best["state"])
        lr2_start = best["lr"]
        LOG.info("restored best phase-1 weights from step %d", best["step"])
    best["state"] = None

    # ---- phase 2: short final phase at seq2, linear decay to the floor
    t_phase2 = train_time
    for i in range(steps2):
        lr = lr2_start + (floor - lr2_start) * (i + 1) / steps2
        x = sampler(batch2, args.seq2)
        sync(device)
        t0 = time.time()
        loss, aux, gnorm = train_step(model, opt, x, lr, device, args.clip,
                                       args.aux_coef, args.balance)
        sync(device)
        train_time += time.time() - t0
        tokens_seen += tok_step2
        step += 1
        if (i + 1) % 50 == 0 or i == 0 or i + 1 == steps2:
            log_step(step, 2, lr, loss, aux, gnorm)
        if args.steps is None and train_time > 1.1 * args.budget:
            LOG.warning("phase 2 over the time budget: stopping after %d of %d steps", i + 1, steps2)
            break
    phase2_steps = step - phase1_steps
    phase2_time = train_time - t_phase2
    LOG.info("training done: %d steps, %.1fM tokens, %.0f s", step, tokens_seen / 1e6, train_time)

    # ---- final evaluation on the bf16 model exactly as it will be saved
    fp32_valid = evaluate(model, valid_w, device, args.eval_batch, autocast=True)
    cast_params_bf16(model)
    model.eval()
    ev_valid = evaluate(model, valid_w, device, args.eval_batch, autocast=False)
    ev_test = evaluate(model, test_w, device, args.eval_batch, autocast=False,
                       n_experts=config.num_local_experts)
    ev_test2 = evaluate(model, test_w2, device, max(1, args.eval_batch // 2), autocast=False)
    uni = unigram_ppl(train, test_w, vocab)
    balance = load_balance(ev_test.pop("expert_counts"))
    LOG.info("PTB valid ppl %.2f (fp32 master + autocast %.2f); PTB test ppl %.2f; at window %d: "
             "%.2f; unigram %.2f", ev_valid["ppl"], fp32_valid["ppl"], ev_test["ppl"], args.seq2,
             ev_test2["ppl"], uni)
    for lb in balance:
        LOG.info("layer %d expert load %s min/max %.3f", lb["layer"], lb["fraction"], lb["min_max_ratio"])

    # ---- save model + tokenizer, then the round trip check
    args.out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # inference default; aux loss coef stays recorded
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    reloaded = MixtralForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).to(device)
    ev_rt = evaluate(reloaded, test_w, device, args.eval_batch, autocast=False)
    rt_ok = abs(ev_rt["ppl"] - ev_test["ppl"]) <= 1e-3 * ev_test["ppl"]
    LOG.info("round trip: PTB test ppl %.4f after reload vs %.4f before (%s)",
             ev_rt["ppl"], ev_test["ppl"], "ok" if rt_ok else "MISMATCH")

    report = {
        "model": "demo-moe",
        "architecture": "MixtralForCausalLM",
        "config": {k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
            "num_experts_per_tok", "max_position_embeddings", "rope_parameters",
            "tie_word_embeddings", "router_aux_loss_coef", "bos_token_id", "eos_token_id")},
        "parameters": n_params,
        "saved_dtype": "bfloat16",
        "seed": args.seed,
        "git_sha": git_sha(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "corpus": {"train_tokens": int(len(train)), "sources": meta["train"]["sources"],
                   "ptb_valid_tokens": int(len(valid)), "ptb_test_tokens": int(len(test)),
                   "tokenizer": f"byte-level BPE, vocab {vocab}, {EOT} = bos = eos = id {eot_id}",
                   "corpus_sha256": meta["sha256"], "notes": meta["notes"]},
        "training": {
            "steps": step, "phase1_steps": phase1_steps, "phase2_steps": phase2_steps,
            "tokens_per_step": {"phase1": tok_step1, "phase2": tok_step2},
            "tokens_seen": tokens_seen, "epochs": round(tokens_seen / len(train), 2),
            "train_time_s": round(train_time, 1), "phase2_time_s": round(phase2_time, 1),
            "wall_time_s": round(time.time() - t_start, 1),
            "throughput_tokens_per_s": round(tokens_seen / train_time),
            "calibrated_tokens_per_s": round(tps_calib) if tps_calib else None,
            "stopped_early": stopped_early, "best_phase1_step": best["step"],
            "final_loss": history[-1]["loss"] if history else None,
            "loss_history": history, "valid_history": valid_history,
        },
        "eval": {
            "protocol": f"non-overlapping windows, positions {SCORE_FROM}..window-1 scored, natural log",
            "ptb_valid": ev_valid, "ptb_test": ev_test,
            f"ptb_test_window_{args.seq2}": ev_test2,
            "ptb_valid_fp32_master_autocast": fp32_valid,
            "unigram_ppl_ptb_test": uni,
            "ptb_test_ppl_after_reload": ev_rt["ppl"], "round_trip_ok": rt_ok,
            "load_balance_ptb_test": balance,
            "load_balance_min_max_ratio_worst_layer": min(lb["min_max_ratio"] for lb in balance),
        },
    }
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = folder_mib(args.out)
    report["saved_folder_mib"] = round(size, 3)
    report["saved_files"] = sorted(p.name for p in args.out.iterdir())
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = folder_mib(args.out)
    LOG.info("saved %s: %s, %.2f MiB", args.out, report["saved_files"], size)

    print(json.dumps({"parameters": n_params, "tokens_seen": tokens_seen, "steps": step,
                      "train_time_s": round(train_time, 1), "ptb_valid_ppl": round(ev_valid["ppl"], 3),
                      "ptb_test_ppl": round(ev_test["ppl"], 3), "unigram_ppl": round(uni, 3),
                      "round_trip_ok": rt_ok, "min_max_load": report["eval"]
                      ["load_balance_min_max_ratio_worst_layer"], "folder_mib": round(size, 3)}))
    if size > MAX_FOLDER_MIB:
        raise SystemExit(f"saved folder is {size:.2f} MiB > {MAX_FOLDER_MIB} MiB")
    if not rt_ok:
        raise SystemExit("round trip perplexity mismatch")
    os.sync()


if __name__ == "__main__":
    main()
