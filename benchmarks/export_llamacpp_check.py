"""Run a `moec export --format gguf` model in llama.cpp (llama-cpp-python) and compare its logits with moec's.

    python3 -m benchmarks.export_llamacpp_check [--model demo-moe] [--recipe w4a16-g32] [--threads 2]
        [--out benchmarks/results/export_llamacpp_check.json]

--recipe: a recipe name or file GGUF carries (rtn4-g32-q4_1 -> Q4_1, the default; w4a16-g32 -> Q4_0;
w8a16-g32 -> Q8_0; experts-mxfp4 -> MXFP4). The results file is a list of records, one per (model, recipe):
a run replaces its own row and keeps the others.

Steps: calibrate + pack MODEL with the recipe, export it to GGUF, then feed the same token ids to moec's CPU
runtime (fp32) and to llama.cpp, and record per position: max |Δlogit|, the logit scale, top-1 agreement and
KL(moec ‖ llama.cpp) — over the first --kl-tokens (512) tokens of PTB test, and over TEXT (37-44 tokens,
the sample of the rows before 2026-12-05: too few for a mean of a KL whose per-token values span
1e-5..0.08); for an MoE, the positions of largest KL with their smallest router margin
(`kl_worst_positions`: a top-k near-tie that llama.cpp's activation rounding flips shows as a spike there).
It also re-checks that every quantized tensor of the file dequantizes (gguf.quants) to
the runtime's weights exactly (`weights_exact`), generates greedily from a prompt in both (`generate`: the
texts, how many leading tokens agree, whether llama.cpp stopped at the exported eos), and compares token
counts of llama.cpp's tokenizer (the exported vocabulary and pre-tokenizer) with the model's HF tokenizer on
a text with digits, punctuation and chat markup (`token_counts`; where they differ, `token_diff` lists the
spans each side splits differently).

The weights are identical; the logits are not bit-equal: llama.cpp's CPU matmuls quantize the activations
(Q8_0 / Q8_1, 8 bits per block of 32) and accumulate in another order. Expect small |Δlogit| against the
logit scale and near-full top-1 agreement, not zeros.

Needs `llama_cpp` importable (llama-cpp-python builds llama.cpp from source; not part of CI).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.benchutil import ROOT, cli

RECIPE = ROOT / "moec" / "recipes" / "rtn4-g32-q4_1.yaml"  # rtn 4-bit g32 on experts and attention: Q4_1 exactly
TOKEN_TEXT = ("<|im_start|>user\nPrice: $1,234.56 (or 12345 in 2024!) -- isn't it \"odd\"?<|im_end|>\n"
              "<|im_start|>assistant\n3.14159... e.g. x=42; y = [1, 2, 3]\n 1) id:   99, col  7\n\n  indented\ttab"
              "<|im_end|>")
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PLAIN_PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"
TEXT = ("The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word was "
        "with the model, which compressed its experts and ran them on a small runtime.")


def kl_rows(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) ‖ softmax(got)) per row."""
    lp_ref = ref - np.logaddexp.reduce(ref, -1, keepdims=True)
    lp_got = got - np.logaddexp.reduce(got, -1, keepdims=True)
    return (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)


def bootstrap_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile interval of x's mean over n resamples of its entries."""
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (n, len(x)))].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def weights_exact(packed: Path, gguf_file: Path) -> bool:
    import gguf
    from gguf.quants import dequantize

    from moec.export.to_gguf import gguf_name, permute_rope_rows
    from moec.formats.checkpoint import load_tensors, read_manifest
    from moec.runtime.config import ModelArgs
    from moec.runtime.experts import pop_quant_experts

    m = read_manifest(packed)
    args = ModelArgs.from_dict(m["model_args"])
    got = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}
    for p, q in pop_quant_experts(load_tensors(packed, m), m).items():
        w = q.dequant_ref()
        if p.endswith(("wq.weight", "wk.weight")):
            w = permute_rope_rows(w[0], args.n_heads if "wq" in p else args.n_kv_heads)[None]
        t = got[gguf_name(p, dense=not args.is_moe)]
        if not torch.equal(torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(w.shape), w):
            return False
    return True


def llama_greedy(llm, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """n tokens (fewer if eos comes) of greedy decoding in llama.cpp: the argmax of its own logits each step."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < n:
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if out[-1] == eos:
            break
        llm.eval(out[-1:])
    return out


def token_diff(hf: list[bytes], lc: list[bytes]) -> list[dict]:
    """The spans where the two tokenizations of one text split differently (pieces as text)."""
    import difflib

    sm = difflib.SequenceMatcher(a=hf, b=lc, autojunk=False)
    return [{"hf": [t.decode(errors="replace") for t in hf[i1:i2]],
             "llama_cpp": [t.decode(errors="replace") for t in lc[j1:j2]]}
            for op, i1, i2, j1, j2 in sm.get_opcodes() if op != "equal"]


def worst_positions(model, ids: list[int], kl: np.ndarray, n: int = 3) -> dict | None:
    """The n positions of largest KL, each with its smallest router margin over the MoE layers (the last chosen
    expert's router logit minus the first unchosen one's, in moec's forward): a margin near zero is a top-k
    near-tie that llama.cpp's activation rounding can flip, a routing difference rather than a weight one.
    None for a dense model."""
    if not model.args.is_moe:
        return None
    k, margins = model.args.top_k, {}

    def observe(layer, name, t):
        if name == "router_logits":
            s = t.float().sort(-1, descending=True).values
            margins[layer] = s[:, k - 1] - s[:, k]

    with torch.no_grad():
        model(torch.tensor([ids]), observer=observe)
    m = torch.stack([margins[i] for i in sorted(margins)])  # [L, T]
    low = m.min(0)
    return {"router_margin_median": float(low.values.median()),
            "top_kl": [{"pos": int(p), "kl": float(kl[p]), "router_margin": float(low.values[p]),
                        "layer": int(low.indices[p])} for p in np.argsort(-kl)[:n]]}


def upsert(path: Path, rec: dict) -> None:
    """Write rec into the list of records at path, replacing the row of the same (model, recipe)."""
    from moec.atomic import atomic_file

    rows = json.loads(path.read_text()) if path.is_file() else []
    rows = [rows] if isinstance(rows, dict) else rows
    rows = [r for r in rows if (r.get("model"), r.get("recipe")) != (rec["model"], rec["recipe"])] + [rec]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(rows, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--recipe", default=str(RECIPE),
                    help="a recipe name or file GGUF carries (Q4_1, Q4_0, Q8_0, MXFP4)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--kl-tokens", type=int, default=512,
                    help="KL over the first N tokens of PTB test (0: over TEXT, the 37-token sentence only)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/export_llamacpp_check.json")
    a = ap.parse_args()

    import llama_cpp  # first: fail before the minutes of calibration when it is missing
    from tokenizers import Tokenizer

    from moec.runtime.generate import generate
    from moec.runtime.loader import load_model

    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        cli("calibrate", a.model, "-r", a.recipe, "--samples", a.samples, "--seq-len", a.seq_len,
            "-o", work / "calib")
        cli("pack", a.model, work / "calib", "-o", work / "packed")
        cli("export", work / "packed", "--format", "gguf", "-o", work / "gguf")
        packed, gguf_file = work / "packed", work / "gguf" / "model.gguf"
        ggml_types = json.loads((work / "gguf" / "moec-export.json").read_text())["quantized_tensors"]
        exact = weights_exact(packed, gguf_file)
        hf_tok = Tokenizer.from_file(str(packed / "tokenizer.json"))
        eos = json.loads((packed / "config.json").read_text()).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        short = hf_tok.encode(TEXT).ids
        if a.kl_tokens:  # the KL sample: held-out natural text, long enough for a mean of a heavy-tailed KL
            from moec.calibrate.data import _ptb

            ids = hf_tok.encode(_ptb("test")).ids[: a.kl_tokens]
        else:
            ids = short
        chat = hf_tok.token_to_id("<|im_start|>") is not None
        prompt = hf_tok.encode(CHAT_PROMPT if chat else PLAIN_PROMPT, add_special_tokens=False).ids

        model, _ = load_model(packed)
        with torch.no_grad():
            ref = model(torch.tensor([ids]))[0].double().numpy()  # [T, V]
            ref_short = model(torch.tensor([short]))[0].double().numpy()
            gen_moec = generate(model, prompt, a.gen_tokens, eos_id=eos, kv_dtype=torch.float32)
        try:
            llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=max(len(ids), len(prompt) + a.gen_tokens) + 8,
                                  logits_all=True, n_threads=a.threads, verbose=False)
        except Exception as e:  # a type or architecture this llama.cpp does not run: record why
            raise SystemExit(f"llama.cpp {llama_cpp.__version__} cannot load the {ggml_types} export: "
                             f"{type(e).__name__}: {e}") from None
        llm.eval(short)
        got_short = np.asarray(llm.scores[: len(short)], dtype=np.float64)
        llm.reset()
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # [T, V]
        gen_lc = llama_greedy(llm, prompt, a.gen_tokens, llm.token_eos())
        hf_ids = hf_tok.encode(TOKEN_TEXT, add_special_tokens=False).ids
        lc_ids = llm.tokenize(TOKEN_TEXT.encode(), add_bos=False, special=True)
        counts = {"hf": len(hf_ids), "llama_cpp": len(lc_ids)}
        diff_spans = token_diff([hf_tok.decode([i], skip_special_tokens=False).encode() for i in hf_ids],
                                [llm.detokenize([i], special=True) for i in lc_ids])
        lead = next((i for i, (x, y) in enumerate(zip(gen_moec, gen_lc, strict=False)) if x != y),
                    min(len(gen_moec), len(gen_lc)))
        generation = {
            "prompt": CHAT_PROMPT if chat else PLAIN_PROMPT, "max_new_tokens": a.gen_tokens,
            "moec": hf_tok.decode(gen_moec, skip_special_tokens=False),
            "llama_cpp": llm.detokenize(gen_lc, special=True).decode(errors="replace"),
            "tokens_moec": len(gen_moec), "tokens_llama_cpp": len(gen_lc), "leading_tokens_equal": lead,
            "eos_config": eos, "eos_llama_cpp": llm.token_eos(),
            "llama_cpp_stopped_at_eos": bool(gen_lc) and gen_lc[-1] == llm.token_eos(),
        }

    diff = np.abs(got - ref)
    kl, kl_short = kl_rows(ref, got), kl_rows(ref_short, got_short)
    worst = worst_positions(model, ids, kl)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "bench": "export_llamacpp_check", "git_sha": sha.stdout.strip(), "date": time.strftime("%Y-%m-%d"),
        "model": a.model, "recipe": Path(a.recipe).stem, "ggml_types": ggml_types,
        "loads": True, "tokens": len(ids), "weights_exact": exact, "token_counts": counts,
        "token_diff": diff_spans, "generate": generation,
        "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
        "logit_std": float(ref.std()), "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
        "kl_moec_llamacpp_mean": float(kl.mean()), "kl_moec_llamacpp_max": float(kl.max()),
        "kl_worst_positions": worst,
        "kl_text": f"PTB test, first {len(ids)} tokens" if a.kl_tokens else "TEXT",
        # a 95% interval of the mean from 2,000 bootstrap resamples of the positions (tokens are not independent:
        # an indication of the sample's spread, not an exact interval)
        "kl_mean_ci95": bootstrap_ci(kl),
        "kl_short_text_mean": float(kl_short.mean()), "kl_short_text_tokens": len(short),
        "seconds": round(time.time() - t0, 1),
        "command": f"python3 -m benchmarks.export_llamacpp_check --model {a.model} --recipe {a.recipe} "
                   f"--threads {a.threads} --kl-tokens {a.kl_tokens}",
        "env": {"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                "machine": platform.machine(), "threads": a.threads},
    }
    upsert(a.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
