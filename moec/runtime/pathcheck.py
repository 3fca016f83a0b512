"""The default decode path against the torch reference, on one model and one KV configuration.

A user gets whatever path the caches and expert modules pick with *default* arguments; that is the
path to check (a crash once hid behind explicit `use_kernel=` arguments that every test passed). For a
model and a packed checkpoint's KV section + calibration tensors, `compare_paths` decodes one prompt
teacher-forced through
  - the static engine (`decode.static_cache_factory` + `DecodeEngine`, CUDA graphs where there is a GPU),
    and
  - the dynamic cache of `loader.kv_cache_factory` (`Transformer.forward` step by step),
each built with default arguments, and again with MOEC_KERNELS=0 (backend.py: the torch reference for
KV attention, KV encode, MoE and quantized projections). It reports whether the kernels were taken and
how far the logits are apart. Used by tests/runtime/test_kernel_paths.py on the CPU (kernels under
TRITON_INTERPRET=1, MOEC_KERNELS=1) and by benchmarks/gpu_smoke.py on the GPU.
"""

from __future__ import annotations

import torch

from .backend import kernels_forced
from .decode import DecodeEngine, static_cache_factory
from .model import Transformer


def _static_logits(model: Transformer, section: dict | None, tensors: dict, ids: torch.Tensor, n_prompt: int,
                   graphs: bool | None = None):
    max_len = -(-ids.numel() // 128) * 128  # whole chunks for the GPU's split attention (kvcache.SPLIT)
    cache = static_cache_factory(section, tensors, model.args)(model, 1, max_len)
    eng = DecodeEngine(model, cache, graphs=graphs)
    out = [eng.prefill(0, ids[:n_prompt])]
    for t in range(n_prompt, ids.numel()):
        eng.tokens[0] = ids[t]
        out.append(eng.step(1)[0].clone())
    return torch.stack(out), getattr(cache, "use_kernel", False), eng.graphs_on


def _dynamic_logits(model: Transformer, section: dict | None, tensors: dict, ids: torch.Tensor, n_prompt: int,
                    graphs: bool | None = None):
    from .loader import kv_cache_factory

    dev = model.tok_embeddings.weight.device
    factory = kv_cache_factory({"kv": section, "kv_tensors": tensors}, model.args)
    if factory is None:
        from .kvcache import dense_cache

        cache = dense_cache(model.args, 1, ids.numel(), device=dev)
    else:
        cache = factory(model, 1, ids.numel())
    ids = ids.to(dev)
    out = [model(ids[None, :n_prompt], cache, 0)[0, -1].float()]
    for t in range(n_prompt, ids.numel()):
        out.append(model(ids[None, t : t + 1], cache, t)[0, -1].float())
    return torch.stack(out), getattr(cache, "use_kernel", False), False


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@torch.no_grad()
def compare_paths(model: Transformer, section: dict | None, tensors: dict, ids: torch.Tensor, n_prompt: int,
                  engines: tuple[str, ...] = ("static", "dynamic"),
                  exact: Transformer | None = None) -> dict[str, dict]:
    """{engine: {kernel, graphs, max_abs_err, rel_l2_err, ...}}: logits after the prompt ids[:n_prompt] and
    after each later token of ids (teacher forced), default path against the torch reference (same dtype;
    the reference runs without CUDA graphs, which its host-synchronizing MoE routing could not capture).
    Every registered KV codec runs in both engines.

    `exact`: the same model in fp32. Then the default path and the reference are also both measured against
    the fp32 torch path (`rel_l2_exact`, `rel_l2_floor`): in bf16 two correct paths differ by rounding and
    by 2-bit codes that rounding flips, and the reference's own distance from fp32 says how much that is."""
    runs = {"static": _static_logits, "dynamic": _dynamic_logits}
    out = {}
    for name in engines:
        got, kernel, graphs = runs[name](model, section, tensors, ids, n_prompt)
        with kernels_forced("0"):
            ref, _, _ = runs[name](model, section, tensors, ids, n_prompt, graphs=False)
            ref32 = None if exact is None else runs[name](exact, section, tensors, ids, n_prompt, graphs=False)[0]
        d = (got - ref).abs()
        out[name] = {"kernel": bool(kernel), "graphs": bool(graphs), "steps": int(got.shape[0]),
                     "max_abs_err": float(d.max()), "ref_max_abs": float(ref.abs().max()),
                     "rel_l2_err": _rel_l2(got, ref),
                     "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}
        if ref32 is not None:
            out[name] |= {"rel_l2_exact": _rel_l2(got, ref32), "rel_l2_floor": _rel_l2(ref, ref32)}
    return out
