"""Which torch ops a decode step still launches, by call site, on the CPU (issues 32, 35, 36).

At batch 1 a step's time past its kernels is launches: every torch op between the Triton kernels is one or more
CUDA kernels a layer (an RMSNorm in torch is eight). The GPU profile names the kernels (`moec-latency-breakdown`:
`direct_copy_kernel_cuda`, `CatArrayBatchedCopy`, elementwise) but not who launched them. This runs the engine's
fused static step on a tiny random model of each family on the CPU with the kernels on (`MOEC_KERNELS=1` under
Triton's interpreter, so the step takes the GPU's code paths), records every aten op dispatched outside the Triton
kernels with the innermost moec line that issued it, and prints the count per (op, line) for one step. Views and
allocations are left out (no kernel); the interpreter's own tensor traffic is left out.

    TRITON_INTERPRET=1 MOEC_KERNELS=1 python3 -m benchmarks.studies.step_census [--families glm,mla,oss,mixtral]
        [--recipe moec/recipes/experts-hls2.yaml] [--out F.json]

Found with it (2026-12-06), each since fused in moec/: gpt-oss's three fp32 copies of the experts' biases a layer
(now passed as stored), DeepSeek's MLA prologue in torch (RMSNorm, interleaved RoPE, cats: now
`fused_decode.mla_rope_latent`), the shared expert as five torch ops a layer (three GEMMs, silu, mul) plus the add
(now gate/up as one GEMM, `fused_decode.silu_mul`, the down GEMM, the add inside the next `add_rms_norm`). Steps
over two layers, experts-hls2: GLM 29 -> 21, DeepSeek 77 -> 25 (also its wq and wkv_a as one GEMM; 21 with
`mla_absorb.patch`: the query's absorption and the cat in the prologue kernel), gpt-oss 23 -> 17, Mixtral 15.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch no kernel (views, metadata, allocation)
NO_KERNEL = {"view", "slice", "select", "transpose", "unsqueeze", "squeeze", "expand", "permute", "t", "detach",
             "alias", "_unsafe_view", "as_strided", "split", "split_with_sizes", "unbind", "empty", "empty_like",
             "empty_strided", "lift_fresh", "_reshape_alias", "reshape", "resolve_conj", "resolve_neg"}


class Census(TorchDispatchMode):
    """Counts aten ops by (op, innermost moec/ file:line), leaving out those issued by Triton's interpreter."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            stack = traceback.extract_stack()
            if not any("triton/runtime/interpreter" in fr.filename for fr in stack):
                mine = [fr for fr in stack if f"{os.sep}moec{os.sep}" in fr.filename]
                site = f"{mine[-1].filename.split(f'{os.sep}moec{os.sep}')[-1]}:{mine[-1].lineno}" if mine else "?"
                self.counts[(name, site)] += 1
        return func(*args, **(kwargs or {}))


def family_args(family: str):
    """A tiny two-layer ModelArgs of the family (the real ones' switches, small dimensions)."""
    from moec.runtime.config import ModelArgs

    base = dict(vocab_size=64, dim=256, n_layers=2, max_seq_len=64, top_k=2, expert_dim=256)
    if family == "glm":
        return ModelArgs(arch="glm4_moe", n_heads=4, n_kv_heads=2, head_dim=64, ffn_kinds=["moe", "moe"], n_experts=4,
                         shared_dim=256, qkv_bias=True, rotary_dim=32, router_score="sigmoid",
                         topk_method="group_top2", n_group=2, topk_group=1, router_bias=True, routed_scale=2.5, **base)
    if family == "mla":
        return ModelArgs(arch="deepseek_v2", n_heads=4, n_kv_heads=4, head_dim=96, ffn_kinds=["moe", "moe"],
                         n_experts=8, shared_dim=256, attn_kind="mla", kv_lora_rank=64, qk_rope_dim=32, v_head_dim=64,
                         rope_interleave=True, **base)
    if family == "oss":
        return ModelArgs(arch="gpt_oss", n_heads=4, n_kv_heads=2, head_dim=64, n_experts=4, qkv_bias=True, o_bias=True,
                         attn_sinks=True, layer_windows=[4, 0], router_score="softmax_topk", router_logit_bias=True,
                         expert_bias=True, expert_act="clamped_swiglu", swiglu_limit=7.0, norm_topk=False, **base)
    if family == "mixtral":
        return ModelArgs(arch="mixtral", n_heads=4, n_kv_heads=2, head_dim=64, n_experts=4, **base)
    raise SystemExit(f"step_census: unknown family {family!r} (glm, mla, oss, mixtral)")


def census(family: str, recipe_path: str) -> dict:
    """{family, recipe, ops_per_step, by_site: [[count, op, site], ...]} for one fused static step."""
    from moec.calibrate.recipe import load_recipe
    from moec.runtime.decode import DecodeEngine
    from moec.runtime.kvcache import dense_cache
    from moec.runtime.latency import random_model

    args = family_args(family)
    recipe = load_recipe(recipe_path)
    model = random_model(args, lambda n: recipe.rule_for(n, args.ffn_kinds), "cpu", torch.bfloat16)
    eng = DecodeEngine(model, dense_cache(args, 1, 32, dtype=torch.bfloat16, device="cpu", mode="static"),
                       graphs=False, fuse=True)
    eng.prefill(0, torch.tensor([3, 9, 27, 17, 51, 8]))
    eng.step(1, feed_next=True)  # first-step work (caches, absorbed weights) out of the count
    with Census() as c:
        eng.step(1, feed_next=True)
    rows = [[n, op, site] for (op, site), n in c.counts.most_common()]
    return {"family": family, "recipe": recipe_path, "layers": args.n_layers, "ops_per_step": sum(c.counts.values()),
            "by_site": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="glm,mla,oss,mixtral")
    ap.add_argument("--recipe", default="moec/recipes/experts-hls2.yaml")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("MOEC_KERNELS") != "1":
        print("step_census: run with TRITON_INTERPRET=1 MOEC_KERNELS=1 (the GPU's code paths on the CPU)",
              file=sys.stderr)
        return 2
    out = []
    for fam in a.families.split(","):
        r = census(fam, a.recipe)
        out.append(r)
        print(f"{fam} ({Path(a.recipe).stem}): {r['ops_per_step']} torch ops a step over {r['layers']} layers")
        for n, op, site in r["by_site"]:
            print(f"  {n:3d}  {op:24s} {site}")
    if a.out:
        from moec.atomic import write_json

        write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
