"""HF transformers QuantizedCache peers (HQQ and quanto backends) on the KV-quality protocol.

Same windows and scored positions as benchmarks/bench_kv_quality.py (docs/benchmarks.md: PTB test, W
tokens per window, prefill 32, then one token at a time, positions 32..W−1 scored), with the HF
model (transformers, fp32, CPU) decoding each window alone (batch 1: HQQ's axis-0 groups span the
whole tensor, so windows decoded together would share quantization groups). The reference is the
same HF model with its plain DynamicCache; kld and top1 are against it. Per-window sums are kept,
so the issue's first-6-window numbers (fp16 cache 54.93, HQQ-4 55.80, quanto-4 55.54) are checked
from the same run (`first6` in each record).

Effective bits, from the tensors the cache holds after the last step of each window: the packed
quantized data, scales and zero points (every floating tensor counted at 2 bytes, as in an fp16
deployment, the HF cache keeping them in the model dtype) and the residual full-precision tokens
(16 bits each). Projected to 32k with the same per-quantized-token bytes and a residual of
`residual_length` tokens (HF's worst case just before re-quantization).

Needs the `bench` extra (hqq, optimum-quanto; see pyproject.toml); not needed by CI:
    pip install --no-deps hqq==0.2.8.post1 optimum-quanto==0.2.7 && pip install einops ninja
    OMP_NUM_THREADS=1 python3 -m benchmarks.bench_kv_peers --model smollm2-135m --max-windows 8
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from moec.calibrate.data import load_text
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.perplexity import CONTEXT, make_windows

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {  # name -> (backend, nbits); None: DynamicCache (the reference)
    "hf-dynamic": None, "hqq-4": ("hqq", 4), "quanto-4": ("quanto", 4), "hqq-2": ("hqq", 2), "quanto-2": ("quanto", 2)}


def _tensor_bytes(t, fp_bytes: int = 2) -> int:
    """Bytes of a (possibly quanto-subclassed) tensor; floating parts counted at fp_bytes per element."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), fp_bytes) for n in names)
    if isinstance(t, (tuple, list)):
        return sum(_tensor_bytes(x, fp_bytes) for x in t)
    if isinstance(t, dict):
        return sum(_tensor_bytes(x, fp_bytes) for x in t.values() if isinstance(x, torch.Tensor))
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    return t.numel() * (fp_bytes if t.is_floating_point() else t.element_size())


def cache_bytes(cache) -> tuple[int, int, int]:
    """(quantized bytes, quantized tokens, residual tokens) summed over layers (K and V)."""
    qb, qt, rt = 0, 0, 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values"):
            qb += _tensor_bytes(getattr(layer, name))
        qt = layer.cumulative_length - layer.keys.shape[-2] if layer.keys.dim() == 4 else layer.cumulative_length
        rt = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    return qb, qt, rt


@torch.no_grad()
def decode_window(model, x: torch.Tensor, cache) -> torch.Tensor:
    """x [1, W] -> logits [W−CONTEXT, V] predicting x[CONTEXT:], token by token after a 32-token prefill."""
    out = [model(x[:, :CONTEXT], past_key_values=cache, use_cache=True).logits[0, -1]]
    for t in range(CONTEXT, x.shape[1] - 1):
        out.append(model(x[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(out).float()


AXIS = 0  # --axis: QuantizedCache's axis_key / axis_value (transformers' default 0)


def make_cache(model, cfg):
    from transformers import DynamicCache, QuantizedCache

    if cfg is None:
        return DynamicCache(config=model.config)
    backend, nbits = cfg
    return QuantizedCache(backend, model.config, nbits=nbits, axis_key=AXIS, axis_value=AXIS, q_group_size=64,
                          residual_length=128)


def summarize(per: list[dict], n: int) -> dict:
    p = per[:n]
    tok = sum(w["n"] for w in p)
    nll, nll_b = sum(w["nll"] for w in p), sum(w["nll_base"] for w in p)
    return {"windows": n, "ppl": math.exp(nll / tok), "ppl_base": math.exp(nll_b / tok),
            "delta_pct": 100.0 * (math.exp((nll - nll_b) / tok) - 1.0), "kld": sum(w["kl"] for w in p) / tok,
            "top1": sum(w["top1"] for w in p) / tok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--axis", type=int, choices=(0, 1), default=0, help="axis_key = axis_value of QuantizedCache")
    a = ap.parse_args()
    global AXIS
    AXIS = a.axis
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    out = a.out or ROOT / "benchmarks" / "results" / f"kv_peers_{a.model}.json"
    model_dir = resolve_model(a.model)
    windows = make_windows(tokenize(load_tokenizer(model_dir), load_text("ptb", "test")), a.window, a.max_windows)
    n = windows.shape[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg0 = model.config
    elems_per_token = cfg0.num_hidden_layers * 2 * cfg0.num_key_value_heads * (
        getattr(cfg0, "head_dim", None) or cfg0.hidden_size // cfg0.num_attention_heads)

    # the reference (DynamicCache) always runs first; its log-probs stay in memory (n × W × vocab fp32)
    names = ["hf-dynamic"] + [c for c in a.configs if c != "hf-dynamic"]
    base: list[torch.Tensor] = []
    records = []
    for name in names:
        t0 = time.time()
        per, bits, bits32 = [], [], []
        try:
            for i in range(n):
                x = windows[i : i + 1]
                cache = make_cache(model, CONFIGS[name])
                logp = torch.log_softmax(decode_window(model, x, cache), -1)
                tg = x[0, CONTEXT:]
                if name == "hf-dynamic":
                    base.append(logp)
                logq = base[i]
                per.append({"n": tg.numel(), "nll": -logp.gather(-1, tg[:, None]).sum().item(),
                            "nll_base": -logq.gather(-1, tg[:, None]).sum().item(),
                            "kl": (logq.exp() * (logq - logp)).sum().item(),
                            "top1": (logq.argmax(-1) == logp.argmax(-1)).sum().item()})
                if CONFIGS[name] is None:
                    bits.append(16.0)
                    bits32.append(16.0)
                else:
                    qb, qt, rt = cache_bytes(cache)
                    tokens = qt + rt
                    per_q = qb / max(qt, 1)  # bytes per quantized token, all layers, K and V
                    bits.append(8.0 * (qb + rt * elems_per_token * 2) / (tokens * elems_per_token))
                    r = 128
                    bits32.append(8.0 * (per_q * (32768 - r) + r * elems_per_token * 2) / (32768 * elems_per_token))
                print(f"{name} window {i}: {time.time() - t0:.0f}s", flush=True)
        except Exception as e:  # a peer that fails is recorded, not fatal
            records.append(base_record("kv_peers", "cpu") | {"model": a.model, "method": name,
                                                             "error": f"{type(e).__name__}: {e}"})
            write_json_atomic(out, records)
            if name == "hf-dynamic":
                raise
            continue
        s8, s6 = summarize(per, n), summarize(per, min(6, n))
        cfg = CONFIGS[name]
        rec = base_record("kv_peers", "cpu") | {
            "model": a.model, "method": name if AXIS == 0 or not cfg else f"{name}-axis1",
            "recipe": "hf-quantized-cache" if cfg else "hf-dynamic-cache",
            "peer": {"impl": "transformers QuantizedCache" if cfg else "transformers DynamicCache",
                     "backend": cfg and cfg[0], "nbits": cfg and cfg[1], "q_group_size": 64,
                     "residual_length": 128, "axis_key": AXIS, "axis_value": AXIS},
            "context": a.window, "batch": 1, "mode": "dec", "dtype": "fp32", "data": "ptb", "split": "test",
            "windows": f"{n} windows (0-{n - 1}) of {a.window}, scored {CONTEXT}..{a.window - 1}",
            "ppl": s8["ppl"], "ppl_base": s8["ppl_base"], "delta_pct": s8["delta_pct"], "kld": s8["kld"],
            "top1": s8["top1"], "kv_bits": sum(bits) / len(bits), "kv_bits_32k": sum(bits32) / len(bits32),
            "kv_bits_note": "floating tensors at 2 bytes (fp16 deployment); 32k: residual_length fp16 tokens",
            "w_bits": 32.0, "first6": s6, "per_window": per, "seconds": round(time.time() - t0)}
        records.append(rec)
        print({k: rec[k] for k in ("method", "ppl", "delta_pct", "kld", "top1", "kv_bits", "kv_bits_32k")},
              "first6:", {k: round(v, 4) for k, v in s6.items()}, flush=True)
        write_json_atomic(out, records)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
