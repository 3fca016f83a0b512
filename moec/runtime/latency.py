"""Decode latency against the HBM floor (docs/benchmarks.md, "Speed"), and random models at real shapes.

Random models: the performance shapes of docs/architecture.md (config.PRESETS) with random weights, built straight
on the device: matrices a recipe quantizes get random stored parts of their codec (codes, plausible
codebooks and scales; no fitting: speed does not depend on the values), the rest random bf16.
`random_stored` is shared with `moec pack --random`, which writes the same tensors to disk.

Floor: bytes one decode step must move over HBM, divided by the device-to-device copy bandwidth
measured in the same process (read + write counted):
    active experts as held (codes + codebooks / bf16), expected distinct experts for a batch of b
        tokens with uniform routing: E·(1 − (1 − A/E)^b) per MoE layer;
    every non-expert weight (attention, norms, router, shared experts, lm_head; the embedding
        table only as the lm_head when tied: a step reads b rows of it otherwise);
    the KV cache as stored (cache.bytes_read: history as packed, window and sinks fp16).
"""

from __future__ import annotations

import math
import statistics

import torch

from ..errors import UserError
from ..registry import weight_codec
from ..rotation import hadamard_signs, pack_signs
from .config import ModelArgs
from .experts import LINEAR_PARAM, QLinear, QuantMatrix, attach, placeholders
from .model import Transformer, build_model

EXPERT_PARAM = ("w1", "w2", "w3")


# -- random models -------------------------------------------------------------------------------------

def random_stored(codec: str, bits: int, shape: tuple[int, int, int], group_size: int, device,
                  gen: torch.Generator | None = None, shared: bool = False) -> dict[str, torch.Tensor]:
    """Random stored parts of `codec` for a stacked matrix [E, O, I] (its registered `random_stored` hook);
    shared: the codec's shared_parts once for every expert (a rule's shared_codebook), as calibration stores them."""
    spec = weight_codec(codec)
    if spec.random_stored is None:
        raise ValueError(f"weight codec {codec!r} has no random stand-in")
    parts = spec.hook("random_stored")(bits, shape, group_size, device, gen)
    return {k: v[:1].contiguous() if shared and k in spec.shared_parts else v for k, v in parts.items()}


def random_rotation(rule, name: str, n_in: int) -> dict[str, torch.Tensor]:
    """{"had_signs": ...} for a rule with `incoherence` (calibrate/recipe.Incoherence), else {}: random
    weights rotate like fitted ones, so a speed run pays for the input rotations. Seeded by the layer
    and input so that w1 and w3 share one rotation, as calibration makes them."""
    inc = getattr(rule, "incoherence", None)
    if inc is None:
        return {}
    block = inc.block_for(n_in)
    if not block:
        raise UserError(f"incoherence block {inc.block} does not divide the input dim {n_in} of {name}")
    layer = int(name.split(".")[1]) if name.startswith("layers.") else 1 << 20  # the LM head: after every layer
    return {"had_signs": pack_signs(hadamard_signs(n_in, block, layer * 4 + ("w2" in name)))}


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = Transformer(args)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


@torch.no_grad()
def random_model(args: ModelArgs, rule_for, device, dtype=torch.bfloat16, seed: int = 0) -> Transformer:
    """A Transformer at `args` with random weights; rule_for(name) -> rule (codec, bits, group_size) or None
    (a Recipe's rule_for). Quantized expert matrices and plain linear weights (attention, shared experts,
    router, LM head: experts.LINEAR_PARAM) become QuantMatrix (ExpertWeights / QLinear, as the loader
    attaches them); anything else stays bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state, quant = {}, {}
    for name, shape in param_shapes(args).items():
        rule = rule_for(name)
        is_expert = ".moe." in name and name.rsplit(".", 1)[-1] in EXPERT_PARAM
        is_attn = LINEAR_PARAM.search(name) is not None
        if rule is not None and not weight_codec(rule.codec).identity and (is_expert or is_attn):
            stacked = shape if is_expert else (1, *shape)  # a plain linear weight is one "expert"
            stored = random_stored(rule.codec, rule.bits, stacked, rule.group_size, device, gen, rule.shared_codebook)
            if not is_expert:  # stored without the E axis, as a packed checkpoint stores it (fp8 scales [O])
                stored = {k: v[0] for k, v in stored.items()}
            quant[name] = QuantMatrix(rule.codec, rule.bits, shape, stored | random_rotation(rule, name, shape[-1]))
            quant[name].param_shape = shape
        elif "norm" in name:
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            state[name] = t.normal_(0, 1.0 / math.sqrt(shape[-1]), generator=gen)
    model = build_model(args, state | placeholders(quant, dtype, device), dtype=dtype, device=device)
    attach(model, quant, device)
    return model


def random_kv_tensors(args: ModelArgs, kv: dict, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Stand-in calibration for a random model's KV cache: the tensors `moec pack` would copy from a
    calibration, drawn by the codec's registered `random_tensors` hook (none: the codec needs none, as
    kivi). Speed and kernel-vs-reference checks do not depend on fitted values, only on every field
    being there so the runtime takes a calibrated cache's path."""
    from ..registry import kv_codec

    spec = kv_codec(kv["codec"])
    if spec.random_tensors is None:
        if spec.tensor_names is not None:
            raise ValueError(f"no random stand-in for KV codec {kv['codec']!r}")
        return {}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return spec.hook("random_tensors")(args, kv, gen, device)


# -- bytes and the floor ----------------------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expected_active(E: int, A: int, b: int) -> float:
    """Expected distinct experts hit by b tokens choosing A of E uniformly."""
    return E * (1.0 - (1.0 - A / E) ** b)


def weight_bytes_per_step(model: Transformer, b: int) -> dict:
    """{experts, non_expert, total}: bytes of weights a decode step of b rows reads."""
    a = model.args
    expert = other = 0
    for blk in model.layers:
        moe = blk.moe
        if moe.codec is not None:  # what the kernels read: codes + fp16 tables/scales, not the fp32 reference lut
            held = sum(_nbytes(t) for n, t in moe.codec.named_buffers() if not n.endswith(".lut"))
        else:
            held = sum(_nbytes(getattr(moe, n)) for n in EXPERT_PARAM)
        if moe.kind == "moe":
            expert += held * expected_active(a.n_experts, a.top_k, b) / a.n_experts
        else:
            expert += held
        for n, t in list(blk.named_parameters()) + list(blk.named_buffers()):
            if not (n.startswith("moe.w") or n.startswith("moe.codec") or n.endswith(".lut")):
                other += _nbytes(t)
    other += _nbytes(model.norm.weight)
    head = model.tok_embeddings.weight if a.tie_embeddings else model.output
    if isinstance(head, QLinear):  # a quantized LM head: what its kernel reads, not the fp32 reference lut
        other += sum(_nbytes(t) for n, t in head.named_buffers() if not n.endswith(".lut"))
    else:
        other += _nbytes(head if isinstance(head, torch.Tensor) else head.weight)
    return {"experts": int(expert), "non_expert": int(other), "total": int(expert + other)}


def copy_bandwidth(device, nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, read + write counted (docs/benchmarks.md, "Floor")."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        dst.copy_(src)
    t1.record()
    torch.cuda.synchronize()
    sec = t0.elapsed_time(t1) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * nbytes * iters / sec


def percentiles(ms: list[float]) -> dict:
    s = sorted(ms)
    q = statistics.quantiles(s, n=10, method="inclusive")
    return {"ms_median": statistics.median(s), "ms_p10": q[0], "ms_p90": q[-1], "steps": len(s)}


def time_replays(fn, steps: int, warmup: int = 5) -> list[float]:
    """ms per call of fn (a graph replay), each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


# -- memory planning (before any allocation) ---------------------------------------------------------------

def kv_bytes_per_token(args: ModelArgs, kv: dict | None, codecs: list | None) -> float:
    """Bytes the static cache allocates per token of capacity (all layers, K and V, one row)."""
    if not kv:
        if args.is_mla:  # one latent row per token and layer (mla.MLACache)
            return args.n_layers * args.latent_dim * 2
        full = sum(1 for w in args.layer_windows if not w)  # a window layer's ring does not grow
        return 2 * full * args.n_kv_heads * args.head_dim * 2
    n = 0.0
    for c, window in zip(codecs, args.layer_windows, strict=True):
        if window:  # a sliding-window layer is an fp16 ring of its window (kvtiered.tiered_cache_factory)
            continue
        for kind in "kv":
            for _, (axis, trail, dtype) in c.fields(kind).items():
                el = math.prod(trail) * torch.empty((), dtype=dtype).element_size() * args.n_kv_heads
                n += el if axis == "token" else el / kv["block"]
    return n


def allocated_bytes(cache) -> int:
    """Bytes of the device tensors a cache holds (buffers, mirror, views; each storage counted once); a
    kvcache.LayerSplitCache, those of its parts."""
    from .kvcache import LayerSplitCache
    from .kvtiered import HistoryStore

    if isinstance(cache, LayerSplitCache):
        return sum(allocated_bytes(c) for c in cache.parts)

    seen: set[int] = set()
    total = 0

    def walk(x) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, HistoryStore):
            walk(vars(x))

    walk(vars(cache))
    return total


def static_bytes_per_token(cache_fn, n1: int = 1024, n2: int = 2048) -> float:
    """Bytes the static cache of `cache_fn(batch, max_len)` allocates per token of capacity (one row),
    measured: two caches of n1 and n2 tokens, the difference of what they hold."""
    sizes = []
    for n in (n1, n2):
        c = cache_fn(1, n)
        sizes.append(allocated_bytes(c))
        del c
    return (sizes[1] - sizes[0]) / (n2 - n1)


def largest_context(args: ModelArgs, batch: int, free_bytes: int, per_token: float, reserve: int) -> int:
    """The largest context whose cache for `batch` rows fits in free_bytes − reserve (multiple of 1024)."""
    n = int((free_bytes - reserve) / max(per_token * batch, 1))
    return max(0, min(n, args.max_seq_len) // 1024 * 1024)


# -- one configuration --------------------------------------------------------------------------------------

def check_fits(args: ModelArgs, batch: int, context: int, per_token: float, device, reserve: int = 3 << 30) -> None:
    """Raise ValueError (before any allocation) when `context` exceeds the model maximum or the memory
    left for a cache of `batch` rows; the message names the largest context that fits."""
    need = context + 64
    if need > args.max_seq_len:
        raise ValueError(f"context {context} (+64 decode steps) exceeds the model maximum of {args.max_seq_len} tokens")
    if torch.device(device).type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    if per_token * batch * need + reserve > free:
        fit = largest_context(args, batch, free, per_token, reserve + 64 * per_token * batch)
        raise ValueError(f"context {context} at batch {batch} needs {per_token * batch * need / 2**30:.1f} GiB of "
                         f"KV cache, {max(free - reserve, 0) / 2**30:.1f} GiB free: the largest context that fits "
                         f"is {fit}")


_ENCODE_WARM: dict[str, bool] = {}


@torch.no_grad()
def measure_decode(model: Transformer, cache_fn, batch: int, context: int, steps: int = 50, e2e_steps: int = 16,
                   bandwidth: float | None = None, seed: int = 0) -> dict:
    """Decode ms/token at `context` for `batch` rows (history filled with random codes, CUDA graphs),
    bytes per step and the floor. cache_fn(batch, max_len) -> static cache."""
    from .decode import DecodeEngine

    max_len = -(-(context + e2e_steps + 128) // 128) * 128  # whole chunks of kvcache.SPLIT
    max_len = min(max_len, model.args.max_seq_len)
    cache = cache_fn(batch, max_len)
    eng = DecodeEngine(model, cache, graphs=True)
    gen = torch.Generator(device=eng.device).manual_seed(seed)
    for r in range(batch):
        cache.fill_random(r, context, gen)
    eng.pos[:batch] = context
    eng.tokens[:batch] = torch.randint(0, model.args.vocab_size, (batch,), device=eng.device, generator=gen)
    eng.step(batch)  # captures the graph of this bucket
    if not eng.graphs:
        raise RuntimeError(f"CUDA graph capture failed: {eng.graph_error}")
    b = batch
    kv_bytes = cache.bytes_read(range(b))
    replay = eng.replay
    one = time_replays(lambda: replay(b), 1, warmup=2)[0]
    steps = max(20, min(steps, int(6000 / max(one, 1e-3))))  # slow rows (long context, batch 16): <= ~6 s
    ms = time_replays(lambda: replay(b), steps)
    if not _ENCODE_WARM.get(type(cache).__name__):  # untimed: the first block encode compiles its kernel
        for _ in range(getattr(cache, "block", 1)):
            eng.step(b, feed_next=True)
        _ENCODE_WARM[type(cache).__name__] = True
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(e2e_steps):  # real steps: graph + position update + host-side block encoding
        eng.step(b, feed_next=True)
    t1.record()
    torch.cuda.synchronize()
    w = weight_bytes_per_step(model, b)
    out = percentiles(ms) | {"ms_e2e": t0.elapsed_time(t1) / e2e_steps, "bytes_per_step": w["total"] + kv_bytes,
                             "bytes_experts": w["experts"], "bytes_non_expert": w["non_expert"], "bytes_kv": kv_bytes,
                             "attention_kernel": getattr(cache, "use_kernel", False)}
    if bandwidth:
        out["floor_ms"] = 1e3 * out["bytes_per_step"] / bandwidth
        out["pct_of_floor"] = 100.0 * out["floor_ms"] / out["ms_median"]
    out["tokens_per_s"] = 1e3 * batch / out["ms_median"]
    del eng, cache
    torch.cuda.empty_cache()
    return out


@torch.no_grad()
def measure_prefill(model: Transformer, cache_fn, context: int, seed: int = 0, warmup: int = 4096) -> dict:
    """Seconds of one real prefill of `context` random tokens (batch 1: causal SDPA forward + cache writes
    and block encoding), after a warm-up prefill of min(context, warmup) tokens on a fresh cache, so Triton
    compiles and autotuning are not counted (the warm-up's own time is recorded as prefill_warmup_s)."""
    from .decode import DecodeEngine

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.args.vocab_size, (context,), generator=g)
    out = {}
    runs = ([("prefill_warmup", min(context, warmup))] if warmup else []) + [("prefill", context)]
    for what, n in runs:
        cache = cache_fn(1, -(-(n + 64) // 128) * 128)
        eng = DecodeEngine(model, cache, graphs=False)
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        eng.prefill(0, prompt[:n])
        t1.record()
        torch.cuda.synchronize()
        sec = t0.elapsed_time(t1) / 1e3
        del eng, cache
        torch.cuda.empty_cache()
        out |= {f"{what}_s": sec, f"{what}_tokens_per_s": n / sec}
    return out


# Bytes a kernel reads per step, as shares of the decode record's byte groups (the kernels whose traffic is
# known from their role; the rest is named with time only): the attention kernel reads the whole KV history,
# gate/up two thirds of the active experts' bytes and down one third.
KERNEL_BYTES = {"_kv_decode_attention_kernel": ("bytes_kv", 1.0), "_gluon_kv_attention": ("bytes_kv", 1.0),
                "flash": ("bytes_kv", 1.0),
                "_fp16_decode_kernel": ("bytes_kv", 1.0), "_mla_decode_kernel": ("bytes_kv", 1.0),
                "_mla_nuq_kernel": ("bytes_kv", 1.0),
                "_gate_up_kernel": ("bytes_experts", 2 / 3), "_down_kernel": ("bytes_experts", 1 / 3)}


def _kernel_group(name: str) -> str:
    k = name.lower()
    if ("attention" in k or "flash" in k or "fmha" in k or "_reduce" in k or "efficient" in k or "fp16_decode" in k
            or "_mla_" in k):  # the MLA latent kernels (kernels/mla_decode_attention.py, mla_nuq_decode_attention.py)
        return "attention"
    if "moe" in k or "gate_up" in k or "down_kernel" in k or "grouped" in k:
        return "moe"
    if "gemm" in k or "gemv" in k or "matmul" in k or "cublas" in k or "nvjet" in k or "sm90" in k:
        return "gemm"
    return "rest"


@torch.no_grad()
def kernel_breakdown(model: Transformer, cache_fn, context: int, steps: int = 20, step_bytes: dict | None = None,
                     bandwidth: float | None = None) -> dict:
    """Where a batch-1 decode step's time goes: torch.profiler over eager steps (no graph, so each
    kernel is visible), device time grouped as attention / moe / gemm / rest by kernel name.
    step_bytes: the decode record's bytes_kv / bytes_experts / bytes_non_expert at this context; with them
    every kernel above 1% of the profiled step carries its bytes and achieved bandwidth where its traffic
    is known (KERNEL_BYTES), and each group its bytes (gemm: the non-expert weights)."""
    from torch.profiler import ProfilerActivity, profile

    from .decode import DecodeEngine

    cache = cache_fn(1, -(-(context + steps + 64) // 128) * 128)
    eng = DecodeEngine(model, cache, graphs=False)
    cache.fill_random(0, context)
    eng.pos[0] = context
    eng.step(1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng._step(1)
        torch.cuda.synchronize()
    groups = {"attention": 0.0, "moe": 0.0, "gemm": 0.0, "rest": 0.0}
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if not t:
            continue
        g = _kernel_group(e.key)
        groups[g] += t / 1e3 / steps
        kernels.append({"kernel": e.key[:120], "group": g, "ms": t / 1e3 / steps, "calls_per_step": e.count / steps})
    total = sum(groups.values())
    kernels.sort(key=lambda r: -r["ms"])
    named = []
    for r in kernels:
        if r["ms"] < 0.01 * total:
            break
        r["share_pct"] = 100 * r["ms"] / total
        key = next((k for k in KERNEL_BYTES if k in r["kernel"]), None)
        if step_bytes and key:
            field, frac = KERNEL_BYTES[key]
            r["bytes"] = int(step_bytes[field] * frac)
            r["gbps"] = r["bytes"] / r["ms"] / 1e6
            if bandwidth:
                r["pct_of_copy"] = 100 * r["bytes"] / (r["ms"] / 1e3) / bandwidth
        named.append({k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()})
    out = {"ms_by_group": groups, "profiled_ms": total, "steps_profiled": steps, "kernels_over_1pct": named,
           "top_kernels": [{"ms": round(r["ms"], 4), "kernel": r["kernel"][:80], "group": r["group"]}
                           for r in kernels[:12]]}
    if step_bytes:
        gb = {"attention": step_bytes["bytes_kv"], "moe": step_bytes["bytes_experts"],
              "gemm": step_bytes["bytes_non_expert"]}
        out["bytes_by_group"] = gb
        out["gbps_by_group"] = {g: gb[g] / groups[g] / 1e6 for g in gb if groups[g]}
    del eng, cache
    torch.cuda.empty_cache()
    return out


def estimate_model_bytes(args: ModelArgs, rule_for) -> int:
    """Device bytes random_model will hold (quantized matrices at their bits, the rest bf16), before building."""
    n = 0
    for name, shape in param_shapes(args).items():
        rule = rule_for(name)
        quant = rule is not None and not weight_codec(rule.codec).identity and (
            (".moe.w" in name and name.rsplit(".", 1)[-1] in EXPERT_PARAM) or LINEAR_PARAM.search(name) is not None)
        n += math.prod(shape) * (rule.bits / 8 if quant else 2)
    return int(n)
