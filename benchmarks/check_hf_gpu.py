"""The transformers round trip on CUDA (moec/hf): a random-weight packed MoE (`pack --random smoke-moe`, 2-bit
hls experts, 4-bit attention projections and the kv-nuq2-rot cache of
moec/recipes/latency-hls2-nuq2-attn4.yaml, its window cut to 16 tokens) loaded by AutoModelForCausalLM on the GPU,
whose experts and projections then run moec's Triton kernels; its logits against moec's own runtime on the
same GPU, and `generate` through MoecCache against moec's dynamic-cache decode (teacher-forced on the
generated tokens), beside the CPU torch reference of both.

    python3 -m benchmarks.check_hf_gpu --out $OUT/hf_roundtrip_gpu.json

Records: check, device, max_abs_diff, mean_abs_diff, top1_agree, and which kernels ran (the module types).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import moec.hf
from moec.atomic import write_json
from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import parse_recipe
from moec.cli.common import base_record
from moec.runtime.config import PRESETS
from moec.runtime.loader import kv_cache_factory, load_model

ROOT = Path(__file__).resolve().parents[1]

RECIPE = ROOT / "moec" / "recipes" / "latency-hls2-nuq2-attn4.yaml"
KV_SMALL = {"window": 16, "sinks": 2, "block": 16}  # 24 + 40 tokens leave the window: the codec is exercised


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(),
            "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "ref_absmax": b.abs().max().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    a = ap.parse_args()
    import yaml
    from transformers import AutoModelForCausalLM

    r = yaml.safe_load(a.recipe.read_text())
    r["kv"] = {**r["kv"], **KV_SMALL}
    recipe = parse_recipe(r)
    base = base_record("hf-roundtrip-gpu", "cuda")
    recs = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "packed"
        args = PRESETS["smoke-moe"]
        pack_random(args, "smoke-moe", recipe, d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to("cuda").eval()
        rt, info = load_model(d, device="cuda")
        ids = torch.randint(0, rt.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad():
            got = hf(ids).logits[0]
            want = rt(ids)[0]
        types = sorted({type(m).__name__ for m in hf.modules() if type(m).__module__.startswith("moec")})
        recs.append(base | {"check": "logits, transformers vs moec runtime (CUDA, kernels)", "modules": types}
                    | diff(got, want))
        # generate through MoecCache, then moec's dynamic cache teacher-forced on the same tokens
        cache = moec.hf.MoecCache.from_packed(d, max_len=128)
        out = hf.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=cache, output_logits=True,
                          return_dict_in_generate=True)
        gen_logits = torch.stack(out.logits, 1)[0]  # [40, V]
        seq = out.sequences[0]
        mc = kv_cache_factory(info, rt.args)(rt, 1, 128)
        P = ids.shape[1]
        with torch.no_grad():
            ref = [rt(seq[None, :P], mc, 0)[0, -1]]
            ref += [rt(seq[None, t : t + 1], mc, t)[0, -1] for t in range(P, seq.shape[0] - 1)]
        recs.append(base | {"check": "generate through MoecCache vs moec dynamic-cache decode (CUDA), 40 tokens"}
                    | diff(gen_logits, torch.stack(ref)))
    for r in recs:
        print(r)
    write_json(a.out, recs)


if __name__ == "__main__":
    main()
