"""Where does the KL between moec and llama.cpp on an exact GGUF export come from? (issue 34's KL target)

`benchmarks/export_llamacpp_check.py` shows the exported weights dequantize (gguf-py) to moec's bit for bit,
yet KL(moec ‖ llama.cpp) is 0.006 on SmolLM2's Q4_0 / Q8_0 exports against 2e-6 on its F16 export.
Hypothesis: llama.cpp's CPU matmuls with quantized weights quantize the activations too (the weight type's
`vec_dot_type`: Q8_0 for Q4_0, Q8_0 and MXFP4 — 32-value blocks, one fp16 scale amax/127, int8 values —
Q8_1 for Q4_1, the same values plus a block sum). This study evaluates moec's packed model (its CPU runtime,
fp32) twice: as is, and with every quantized projection's input rounded the way llama.cpp rounds it
(attention: forward pre-hooks; the MLP: its expert function), and compares both with llama.cpp's logits on the same ids.
If the rounded reference lands near llama.cpp, the residual is the peer's activation rounding, not the
export.

    python3 -m benchmarks.studies.llamacpp_act_rounding --model smollm2-135m --recipe w4a16-g32 [--threads 1]

Dense models without incoherence (the MLP's inputs are rounded in ExpertWeights.expert, the reference
path). Needs llama_cpp importable.
Writes benchmarks/results/llamacpp_act_rounding.json (one record per model and recipe).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.benchutil import ROOT, cli
from benchmarks.export_llamacpp_check import TEXT, upsert, weights_exact

PROJ = ("wq", "wk", "wv", "wo")  # the runtime's attention projections; the MLP's inputs: _rounded_expert


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's quantize_row_q8_0 does: blocks of 32 along the last dim, d = amax / 127 stored in
    fp16, values round(x / d) (to nearest, ties away from zero as roundf), dequantized back."""
    shape = x.shape
    b = x.float().reshape(-1, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127.0)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.sign(b * inv) * torch.floor((b * inv).abs() + 0.5)  # roundf: half away from zero
    return (q * d.half().float()).reshape(shape).to(x.dtype)


def _rounded_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
    """runtime/experts.ExpertWeights.expert with its two matmul inputs rounded as llama.cpp rounds them
    (recipes without incoherence: no input rotation)."""
    import torch.nn.functional as F

    w1, w3, w2 = (self.weight(n, e, x.dtype) for n in ("w1", "w3", "w2"))
    xq = q8_0(x)
    return q8_0(F.silu(xq @ w1.t()) * (xq @ w3.t())) @ w2.t()


def _f16_attention(q, k, v, is_causal=False, enable_gqa=False, attn_mask=None, scale=None, **_):
    """Causal attention with q, k, v and the probabilities rounded to fp16 (llama.cpp's CPU path: an F16 KV
    cache, F16 operands of both matmuls, fp32 accumulation and softmax)."""
    H, K = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(H // K, 1) for t in (k, v))
    f16 = lambda t: t.half().float()  # noqa: E731
    s = f16(q) @ f16(k).transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        T, S = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    return (f16(torch.softmax(s, -1)) @ f16(v)).to(q.dtype)


def kl_mean(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    lp_ref = ref - np.logaddexp.reduce(ref, -1, keepdims=True)
    lp_got = got - np.logaddexp.reduce(got, -1, keepdims=True)
    kl = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)
    return float(kl.mean()), float(kl.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="w4a16-g32")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ptb-tokens", type=int, default=0, help="evaluate the first N tokens of PTB test instead of "
                    "the export check's text")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/llamacpp_act_rounding.json")
    a = ap.parse_args()
    import llama_cpp
    from tokenizers import Tokenizer

    from moec.runtime.experts import ExpertWeights
    from moec.runtime.loader import load_model

    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        cli("calibrate", a.model, "-r", a.recipe, "--samples", a.samples, "--seq-len", a.seq_len, "-o", work / "c")
        cli("pack", a.model, work / "c", "-o", work / "p")
        cli("export", work / "p", "--format", "gguf", "-o", work / "g")
        gguf_file = work / "g" / "model.gguf"
        types = json.loads((work / "g" / "moec-export.json").read_text())["quantized_tensors"]
        exact = weights_exact(work / "p", gguf_file)
        import gguf

        gguf_types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(gguf_file).tensors}
        tok = Tokenizer.from_file(str(work / "p" / "tokenizer.json"))
        if a.ptb_tokens:  # the first N tokens of PTB test: more tokens than the check's text, same protocol
            from moec.calibrate.data import _ptb

            ids = tok.encode(_ptb("test")).ids[: a.ptb_tokens]
        else:
            ids = tok.encode(TEXT).ids
        model, _ = load_model(work / "p")  # moec's CPU runtime, fp32: the export check's reference
        with torch.no_grad():
            plain = model(torch.tensor([ids]))[0].double().numpy()
            hooked = [m.register_forward_pre_hook(lambda _m, args: (q8_0(args[0]), *args[1:]))
                      for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJ]
            expert = ExpertWeights.expert
            ExpertWeights.expert = _rounded_expert  # the MLP's gate/up and down inputs, inside the module
            sdpa = F.scaled_dot_product_attention
            try:
                rounded = model(torch.tensor([ids]))[0].double().numpy()
                # and as llama.cpp's CPU attention (no flash): K and V cached in F16, q and the softmax
                # probabilities converted to F16 for the two matmuls; the LM head's input to F16 for an F16 head
                F.scaled_dot_product_attention = _f16_attention
                if gguf_types.get("output.weight", gguf_types.get("token_embd.weight")) == "F16":
                    hooked.append(model.norm.register_forward_hook(lambda _m, _a, out: out.half().float()))
                rounded_all = model(torch.tensor([ids]))[0].double().numpy()
            finally:
                F.scaled_dot_product_attention = sdpa
                ExpertWeights.expert = expert
                for h in hooked:
                    h.remove()
        llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=len(ids) + 8, logits_all=True,
                              n_threads=a.threads, verbose=False)
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        del llm
        other = {}  # llama.cpp against itself at other thread counts: its own run-to-run floor
        for n in (2, 4):
            llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=len(ids) + 8, logits_all=True, n_threads=n,
                                  verbose=False)
            llm.eval(ids)
            other[n] = kl_mean(got, np.asarray(llm.scores[: len(ids)], dtype=np.float64))[0]
            del llm
    kl_plain, kl_plain_max = kl_mean(plain, got)
    kl_round, kl_round_max = kl_mean(rounded, got)
    kl_self, _ = kl_mean(plain, rounded)
    kl_all, kl_all_max = kl_mean(rounded_all, got)
    rec = {"bench": "llamacpp_act_rounding", "date": time.strftime("%Y-%m-%d"), "model": a.model,
           "recipe": a.recipe, "ggml_types": types, "weights_exact": exact, "tokens": len(ids),
           "hooked_projections": len(hooked),
           "kl_moec_llamacpp_mean": kl_plain, "kl_moec_llamacpp_max": kl_plain_max,
           "kl_moec_q8act_llamacpp_mean": kl_round, "kl_moec_q8act_llamacpp_max": kl_round_max,
           "kl_moec_moec_q8act_mean": kl_self,
           "kl_moec_q8act_f16attn_llamacpp_mean": kl_all, "kl_moec_q8act_f16attn_llamacpp_max": kl_all_max,
           "kl_llamacpp_threads_vs_other_threads": {f"{a.threads}_vs_{n}": v for n, v in other.items()},
           "lm_head_type": gguf_types.get("output.weight", gguf_types.get("token_embd.weight")),
           "seconds": round(time.time() - t0, 1),
           "text": f"PTB test, first {a.ptb_tokens} tokens" if a.ptb_tokens else "export_llamacpp_check.TEXT",
           "command": f"python3 -m benchmarks.studies.llamacpp_act_rounding --model {a.model} --recipe {a.recipe} "
                      f"--threads {a.threads}" + (f" --ptb-tokens {a.ptb_tokens}" if a.ptb_tokens else ""),
           "env": {"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__}}
    upsert(a.out, rec)
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
