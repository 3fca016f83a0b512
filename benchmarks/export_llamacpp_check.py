"""Run a `moec export --format gguf` model in llama.cpp (llama-cpp-python) and compare its logits with moec's.

    python3 -m benchmarks.export_llamacpp_check [--model demo-moe] [--recipe w4a16-g32]
        [--out benchmarks/results/export_llamacpp_check.json]

--recipe: any recipe GGUF carries (rtn4-g32-q4_1 -> Q4_1, the default; w4a16-g32 -> Q4_0; w8a16-g32 -> Q8_0).
The record also compares token counts of llama.cpp's tokenizer (the exported vocabulary and pre-tokenizer)
with the model's HF tokenizer on a text with digits, punctuation and chat markup (`token_counts`).

Steps: calibrate + pack MODEL with rtn 4-bit groups of 32 on the experts and attention (the one codec GGUF
carries: Q4_1), export it, then feed the same token ids to moec's CPU runtime (fp32) and to llama.cpp, and
record per position: max |Δlogit|, the logit scale, top-1 agreement and KL(moec ‖ llama.cpp). It also
re-checks that every Q4_1 tensor of the file dequantizes (gguf.quants) to the runtime's weights exactly.

The weights are identical; the logits are not bit-equal: llama.cpp's CPU matmuls with Q4_1 weights quantize
the activations to Q8_1 (8 bits per block of 32) and accumulate in another order. Expect small |Δlogit|
against the logit scale and near-full top-1 agreement, not zeros.

Needs `llama_cpp` importable (llama-cpp-python builds llama.cpp from source; not part of CI).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.benchutil import ROOT, cli

RECIPE = ROOT / "moec" / "recipes" / "rtn4-g32-q4_1.yaml"  # rtn 4-bit g32 on experts and attention: Q4_1 exactly
TOKEN_TEXT = ("<|im_start|>user\nPrice: $1,234.56 (or 12345 in 2024!) -- isn't it \"odd\"?<|im_end|>\n"
              "<|im_start|>assistant\n3.14159... e.g. x=42; y = [1, 2, 3]\n\n  indented\ttab<|im_end|>")
TEXT = ("The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word was "
        "with the model, which compressed its experts and ran them on a small runtime.")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="a recipe GGUF carries (Q4_1, Q4_0, Q8_0)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/export_llamacpp_check.json")
    a = ap.parse_args()

    import llama_cpp  # first: fail before the minutes of calibration when it is missing
    from tokenizers import Tokenizer

    from moec.atomic import atomic_file
    from moec.runtime.loader import load_model

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        cli("calibrate", a.model, "-r", a.recipe, "--samples", a.samples, "--seq-len", a.seq_len,
            "-o", work / "calib")
        cli("pack", a.model, work / "calib", "-o", work / "packed")
        cli("export", work / "packed", "--format", "gguf", "-o", work / "gguf")
        packed, gguf_file = work / "packed", work / "gguf" / "model.gguf"
        exact = weights_exact(packed, gguf_file)
        ids = Tokenizer.from_file(str(packed / "tokenizer.json")).encode(TEXT).ids

        model, _ = load_model(packed)
        with torch.no_grad():
            ref = model(torch.tensor([ids]))[0].double().numpy()  # [T, V]
        llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=len(ids) + 8, logits_all=True, n_threads=a.threads,
                              verbose=False)
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # [T, V]
        hf_tok = Tokenizer.from_file(str(packed / "tokenizer.json"))
        counts = {"hf": len(hf_tok.encode(TOKEN_TEXT, add_special_tokens=False).ids),
                  "llama_cpp": len(llm.tokenize(TOKEN_TEXT.encode(), add_bos=False, special=True))}

    diff = np.abs(got - ref)
    lp_ref = ref - np.logaddexp.reduce(ref, -1, keepdims=True)
    lp_got = got - np.logaddexp.reduce(got, -1, keepdims=True)
    kl = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)
    result = {
        "bench": "export_llamacpp_check", "model": a.model, "recipe": a.recipe.stem,
        "tokens": len(ids), "weights_exact": exact, "token_counts": counts,
        "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
        "logit_std": float(ref.std()), "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
        "kl_moec_llamacpp_mean": float(kl.mean()), "kl_moec_llamacpp_max": float(kl.max()),
        "env": {"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                "machine": platform.machine(), "threads": a.threads},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(a.out) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
