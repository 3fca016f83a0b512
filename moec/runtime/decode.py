"""The static decode engine: one decode step over preallocated buffers, captured as a CUDA graph.

Shape legend: B = batch capacity, b = rows in this step (a bucket <= B), L = layers, K = KV heads,
H = query heads, G = H / K, d = head dim, S = cache capacity in tokens, V = vocab, D = model dim.

Everything a decode step reads or writes lives in buffers allocated once: the input tokens [B],
the per-row positions [B] (device int64, so RoPE and the cache append index by them without a
host round trip), the KV cache and the logits. One captured graph per batch-size bucket then
serves every step: rows advance by updating `pos` in place, never by re-capturing.

Two static caches (the `static` mode of a cache family, moec/runtime/kvcache.py):
  FP16Cache         [B, K, S, d] fp16 per layer; the step appends at pos[b] and attends over the
                    whole buffer with a length mask (SDPA; the G query heads of a KV head become the
                    query rows, so no GQA expansion copy is made).
  TieredKVCache     (static mode) the tiered layout of moec/runtime/kvtiered.py with static buffers:
                    fp16 sinks +
                    window (a buffer of sinks + window + block slots, kept compact) and a
                    preallocated packed history. A step appends the new token at slot
                    pos − hist_len and attends (the fused `kv_decode_attention` kernel with
                    hist_len / win_len as device int32 tensors, or, without it, SDPA over a
                    dequantized mirror with a mask). Every `block` steps, outside the graph, the
                    oldest block of the window is encoded into the history (codec.encode, the same
                    rule and rounding as the dynamic mode) and the window shifts down. The tier rule
                    and the history are kvtiered.TierPolicy / HistoryStore, and the ageing is
                    TieredKVCache._age, shared with the dynamic and simulated modes, so every
                    registered block codec runs here; the latent and RVQ families run their static
                    mode the same way (latent: layer groups encoded together; RVQ: blocks re-encoded
                    into the archive tier), attending over their mirror. `static_cache_factory`
                    builds the cache of any registered codec.

Prefill takes the plain causal forward (SDPA/flash), reads each layer's post-RoPE K/V through the
model's observer hook and writes them into the static cache, encoding the blocks older than the
window as the dynamic mode does. The engine runs on the CPU too (no graphs): the test suite checks
its ppl_dec against moec/runtime/perplexity.py's reference path.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ..registry import weight_codec
from .backend import capturing, gluon_chosen, kernels_enabled
from .config import ModelArgs
from .experts import QLinear
from .kvcache import dense_cache
from .model import MoE, Transformer, apply_rope, expert_act, rope_cos_sin, route

log = logging.getLogger(__name__)

# the fused step computes the router in the shared expert's gate/up GEMV (DecodeEngine._fuse_shared): set by the step's
# A/B on the GPU (benchmarks/studies/fp4h_flip.py --decide-switches, MOEC_ROUTER_IN_SHARED=0/1)
ROUTER_IN_SHARED_DEFAULT = True
# the router's decode GEMV routes in its epilogue (qlinear route, graph_safe_moe): set by the step's A/B likewise
# (MOEC_ROUTE_IN_GEMV=0/1)
ROUTE_IN_GEMV_DEFAULT = False

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _power_of_two(name: str, value) -> int:
    """A block size from the launch config or its environment override: a power of two, else a one-line error."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        v = 0
    if v < 1 or v & (v - 1):
        raise ValueError(f"{name}={value!r}: expected a power of two (rows a program)")
    return v


def bucket_for(b: int, capacity: int) -> int:
    """The smallest graph bucket holding b rows (the capacity itself past the last bucket)."""
    return next((x for x in BUCKETS if b <= x <= capacity), capacity)


# -- caches ------------------------------------------------------------------------------------------

# -- the engine -----------------------------------------------------------------------------------------

def graph_safe_moe(moe: MoE, x: torch.Tensor, layer: int, shared: bool = True, exact_dtype: bool = True,
                   logits: torch.Tensor | None = None,
                   routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE layer without host syncs (for capture). x [N, D]; shared=False: the routed experts only (the fused
    step runs the shared expert itself, DecodeEngine._fuse_shared); exact_dtype=False: the routed output may come
    in fp32 (the split down GEMV's accumulator) for a caller that rounds it to x's dtype (QuantExperts.fused);
    logits: the router's output on x, made by the caller (the fused step's router rows in the shared expert's
    gate/up GEMV, DecodeEngine._fuse_shared), for the routing kernels instead of the router's own launch; routed:
    (weights, ids) already routed by the caller (that GEMV's routing epilogue). Without either, the router's decode
    GEMV routes in its epilogue where ROUTE_IN_GEMV_DEFAULT or MOEC_ROUTE_IN_GEMV says (_route_in_gemv), else the
    routing kernels run after it.

    Routing: the router GEMV, softmax, top-k and renormalization in one kernel at decode batch sizes and up
    to 32 experts (kernels/route_topk.py route_gemv_topk), else the GEMV then one kernel for the rest
    (route_topk, or route_sigmoid_topk for DeepSeek-V3 / GLM-4.5's sigmoid group routing; torch's route is a
    GEMM and ~6-15 small kernels). Quantized
    experts go through their fused kernels (QuantExperts.fused); unquantized (bf16) routed experts through
    the same fused kernels in their dense mode (kernels/dequant.py MODE_DENSE), which read only the chosen
    experts; without them, a gather of the chosen experts' matrices ([N·A, I, D] copies: capturable, but the
    active weights are written and read again). Dense MLPs, CPU tensors and codecs without a fused kernel
    take MoE.forward."""
    if moe.kind == "dense" and moe.codec is not None and moe.codec.fused_ok(x):
        # a quantized dense MLP is one always-taken expert: the fused kernels with id 0 and weight 1 (its torch
        # path dequantizes the whole matrices every step: ~1 ms for DeepSeek-V2-Lite's first layer on an H100)
        N = x.shape[0]
        return moe.codec.fused(x, torch.ones(N, 1, device=x.device, dtype=torch.float32),
                               torch.zeros(N, 1, device=x.device, dtype=torch.int32), moe.args)
    if moe.kind == "dense" or not kernels_enabled(x.device) or (moe.codec is not None and not moe.codec.fused_ok(x)):
        return moe(x, layer, shared=shared)
    a = moe.args
    if routed is None and logits is None:
        routed = _route_in_gemv(moe, x)
    if routed is not None:
        w, ids = routed
    elif plain_softmax_routing(moe):
        w, ids = _route(x, moe.router, a.top_k, a.norm_topk, logits=logits)  # [N, A] ×2
    elif softmax_topk_routing(moe):  # gpt-oss: the softmax over the kept logits is softmax, top-k, renormalize
        w, ids = _route(x, moe.router, a.top_k, True, a, logits)
    else:  # DeepSeek's / GLM's scores, groups, bias and scale: one kernel where it applies, else torch's route
        w, ids = _route_scored(moe, x, logits)
    if moe.codec is not None:
        out = moe.codec.fused(x, w, ids, a, moe.biases(), exact_dtype=exact_dtype)
    else:
        out = _dense_kernel_moe(moe, x, w, ids, exact_dtype)
        if out is None:
            out = _gather_moe(moe, x, w, ids)
    if shared and hasattr(moe, "shared"):
        s = moe.shared(x)
        if hasattr(moe, "shared_gate"):
            s = torch.sigmoid(moe.shared_gate(x)) * s
        out = out + s
    return out


def _router_folds(moe: MoE) -> bool:
    """Whether the fused step may compute this MoE's router in the shared expert's gate/up GEMV: a plain Linear
    without bias, more experts than route_gemv_topk takes (it fuses the router GEMV itself), and routing that the
    kernels run from the logits (plain softmax, or the sigmoid scores of route_sigmoid_topk)."""
    from ..kernels.route_topk import GEMV_MAX_EXPERTS

    a, r = moe.args, moe.router
    sigmoid = a.router_score == "sigmoid" and a.topk_method in ("greedy", "group_top2")
    return (type(r) is torch.nn.Linear and r.bias is None and r.weight.shape[0] > GEMV_MAX_EXPERTS
            and (plain_softmax_routing(moe) or sigmoid))


def plain_softmax_routing(moe: MoE) -> bool:
    """Softmax over every expert then top-k (and renormalization): what the routing kernels compute."""
    a = moe.args
    return (a.router_score, a.topk_method, a.routed_scale) == ("softmax", "greedy", 1.0) and \
        not hasattr(moe, "score_bias") and moe.router.bias is None


def softmax_topk_routing(moe: MoE) -> bool:
    """gpt-oss's routing (router_score softmax_topk, its logits biased or not, no scale): the softmax over the top-k
    logits equals the softmax over all of them, top-k, renormalized, which the routing kernel computes."""
    a = moe.args
    return a.router_score == "softmax_topk" and a.routed_scale == 1.0 and not hasattr(moe, "score_bias")


_ROUTE_FAILED: list[str] = []  # the routing kernel failed to compile here: torch's route instead


def _routing_kernel_failed(e: Exception) -> None:
    """A routing kernel raised: inside a CUDA-graph capture that is fatal (re-raised); before it (the warm-up
    step), remembered once so every later step takes torch's routing."""
    if capturing():
        raise e
    _ROUTE_FAILED.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    log.warning("routing kernel failed (%s); using torch's routing", _ROUTE_FAILED[0])


def _route(x: torch.Tensor, router: torch.nn.Linear, top_k: int, norm: bool,
           args: ModelArgs | None = None, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [N, A] of model.route, its softmax/top-k in one kernel where it compiles; router: the MoE's
    (its bias, where it has one, added to the logits: one GEMV launch, the router module's own, _DenseGEMV on the
    dense route); args: the model's, for torch's route; logits: router(x) already made by the caller."""
    weight, bias = router.weight, router.bias
    if not _ROUTE_FAILED:
        try:
            from ..kernels.route_topk import GEMV_MAX_EXPERTS, GEMV_MAX_TOKENS, route_gemv_topk, route_topk

            if logits is not None:
                return route_topk(logits, top_k, norm)
            if (bias is None and x.shape[0] <= GEMV_MAX_TOKENS and weight.shape[0] <= GEMV_MAX_EXPERTS
                    and x.dtype == weight.dtype and x.is_contiguous()):
                return route_gemv_topk(x, weight, top_k, norm)  # the router GEMV in the same launch
            return route_topk(router(x), top_k, norm)
        except Exception as e:  # the warm-up step (outside capture) meets compile errors first
            _routing_kernel_failed(e)
    _, w, ids = route(x, weight, top_k, norm, args, None, bias)
    return w, ids


def route_spec(moe: MoE) -> dict | None:
    """qlinear's `route` for this MoE's routing where the GEMV's epilogue computes it (plain softmax; gpt-oss's
    softmax over the top-k, its router bias in the GEMV; sigmoid scores with the correction bias in one group),
    None otherwise (group-limited choice, DeepSeek-V2's group_max)."""
    a = moe.args
    E = moe.router.weight.shape[0]
    if plain_softmax_routing(moe):
        return dict(experts=E, top_k=a.top_k, norm=a.norm_topk, kind="softmax")
    if softmax_topk_routing(moe):
        return dict(experts=E, top_k=a.top_k, norm=True, kind="softmax")
    one_group = a.topk_method == "greedy" or (a.topk_method == "group_top2" and a.topk_group == a.n_group)
    if a.router_score == "sigmoid" and one_group:
        return dict(experts=E, top_k=a.top_k, norm=a.norm_topk, kind="sigmoid",
                    score_bias=getattr(moe, "score_bias", None), scale=a.routed_scale)
    return None


def route_in_gemv_on() -> bool:
    return os.environ.get("MOEC_ROUTE_IN_GEMV", "1" if ROUTE_IN_GEMV_DEFAULT else "0") == "1"


def _route_in_gemv(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights, ids) from the router's decode GEMV with the routing in its epilogue (qlinear `route`: one launch
    a layer fewer) where it applies: the router on the dense GEMV route (_DenseGEMV), the switch on, routing that
    route_spec covers, and not the ≤ GEMV_MAX_EXPERTS unbiased softmax routers that route_gemv_topk already does
    in one launch; None otherwise (the caller routes as before)."""
    from ..kernels.qlinear import GEMV_MAX_M, ROUTE_MAX_EXPERTS
    from ..kernels.route_topk import GEMV_MAX_EXPERTS

    router = moe.router
    if _ROUTE_FAILED or not route_in_gemv_on() or not isinstance(router, _DenseGEMV) or x.shape[0] > GEMV_MAX_M:
        return None
    spec = route_spec(moe)
    E = router.out_features
    if spec is None or E > ROUTE_MAX_EXPERTS or (E <= GEMV_MAX_EXPERTS and router.bias is None
                                                and spec["kind"] == "softmax"):
        return None
    try:
        _, w, ids = router.route(x, spec)
        return w, ids
    except Exception as e:  # the warm-up step (outside capture) meets compile errors first
        _routing_kernel_failed(e)
        return None


def _route_scored(moe: MoE, x: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of model.route for routing other than plain softmax: sigmoid scores with the correction bias
    and group top-2 (DeepSeek-V3, GLM-4.5) in one kernel after the router GEMV (kernels/route_topk.py
    route_sigmoid_topk; torch's route is ~15 small launches a layer), anything else (DeepSeek-V2's group_max)
    through torch's route; no host sync either way (capturable)."""
    a, bias = moe.args, getattr(moe, "score_bias", None)
    if a.router_score == "sigmoid" and a.topk_method in ("greedy", "group_top2") and not _ROUTE_FAILED:
        groups = (a.n_group, a.topk_group) if a.topk_method == "group_top2" else (1, 1)
        try:
            from ..kernels.route_topk import route_sigmoid_topk

            return route_sigmoid_topk(moe.router(x) if logits is None else logits, bias, a.top_k, a.norm_topk,
                                      *groups, a.routed_scale)
        except Exception as e:  # the warm-up step (outside capture) meets compile errors first
            _routing_kernel_failed(e)
    _, w, ids = route(x, moe.router.weight, a.top_k, a.norm_topk, a, bias, moe.router.bias)
    return w, ids


_DENSE_FAILED: set[str] = set()  # dense-mode kernels that failed here (compile errors): gather instead


def _dense_kernel_moe(moe: MoE, x, w, ids, exact_dtype: bool = True) -> torch.Tensor | None:
    """The bf16 routed experts through the fused kernels in their dense mode; exact_dtype=False: the decode GEMV's
    output as it comes (fp32 where the down GEMV splits and adds with atomics), for a caller that rounds it (the
    fused step's add_rms_norm), instead of a cast launch a layer."""
    try:
        from ..kernels.dequant import MODE_DENSE, QWeight
        from ..kernels.moe_decode import moe_decode
        from ..kernels.moe_prefill import moe_grouped
        from .experts import DECODE_MAX_TOKENS
    except ImportError:
        return None
    kind = "decode" if x.shape[0] <= DECODE_MAX_TOKENS else "grouped"
    if kind in _DENSE_FAILED:
        return None
    qs = [QWeight(MODE_DENSE, 16, t.shape[2], t) for t in (moe.w1, moe.w3, moe.w2)]
    extra = dict(biases=moe.biases(), act=moe.args.expert_act, limit=moe.args.swiglu_limit)
    try:
        if kind == "decode":
            return moe_decode(x, ids, w, *qs, out_dtype=x.dtype if exact_dtype else None, **extra)
        return moe_grouped(x, ids, w, *qs, **extra).to(x.dtype)
    except Exception as e:  # the warm-up step (outside capture) meets compile errors first
        if capturing():
            raise
        log.warning("dense %s MoE kernel failed (%s: %s); gathering the active experts instead", kind,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        _DENSE_FAILED.add(kind)
        return None


def _gather_moe(moe: MoE, x, w, ids) -> torch.Tensor:
    N, A = ids.shape
    flat = ids.reshape(-1)
    xa = x.repeat_interleave(A, dim=0)[:, :, None]  # [N·A, D, 1]
    g, u = torch.bmm(moe.w1[flat], xa)[..., 0], torch.bmm(moe.w3[flat], xa)[..., 0]  # [N·A, I]
    b = moe.biases()
    if b is not None:
        g, u = g + b[0][flat].to(g.dtype), u + b[1][flat].to(u.dtype)
    h = expert_act(g, u, moe.args)[..., None]  # [N·A, I, 1]
    y = torch.bmm(moe.w2[flat], h)[:, :, 0]  # [N·A, D]
    if b is not None:
        y = y + b[2][flat].to(y.dtype)
    y = y.view(N, A, -1)  # [N, A, D]
    return (y.float() * w[..., None]).sum(1).to(x.dtype)


class _QuantQKV(torch.nn.Module):
    """q, k, v projections of one quantized codec as one kernel launch (moec/kernels/qlinear.py): their
    stored parts (and biases, where all three have one) concatenated along the outputs, the three QuantMatrix
    buffers re-pointed to views of the concatenation (no extra memory). Three GEMVs of 4096 -> 4096 / 1024 /
    1024 at 4 bits cost ~28 us of which ~2/3 is per-launch latency (results/qlinear_sweep2_h200.json)."""

    PARTS = ("codes", "scale", "zero", "lut16", "poly", "fp8", "lut")

    def __init__(self, qw, bias):
        super().__init__()
        self.qw, self.bias = qw, bias

    @classmethod
    def fuse(cls, ws) -> _QuantQKV | None:
        qs = [w.q for w in ws]
        key = {(q.codec, q.bits, q.shape[2], q.kernel_mode) for q in qs}
        if len(key) != 1 or not all(q.kernel_ok() for q in qs) or len({w.bias is None for w in ws}) != 1:
            return None
        if any(q.rotated for q in qs):  # incoherence: each QLinear rotates its input itself (separate launches)
            return None
        if not all(weight_codec(q.codec).rows_concat for q in qs):  # e.g. vq: a codebook per matrix
            return None
        names = [n for n in cls.PARTS if all(isinstance(getattr(q, n, None), torch.Tensor) for q in qs)]
        if any(len({getattr(q, n).shape[2:] for q in qs}) != 1 for n in names):  # groups differ
            return None
        with torch.no_grad():
            fused = {n: torch.cat([getattr(q, n) for q in qs], dim=1) for n in names}
            o = 0
            for q in qs:
                for n in names:
                    setattr(q, n, fused[n][:, o : o + q.shape[1]])
                o += q.shape[1]
        q0 = qs[0]
        q0_parts = {n: getattr(q0, n) for n in names}
        for n in names:  # qweight() of the first matrix, pointed at the whole concatenation
            setattr(q0, n, fused[n])
        qw = q0.qweight()
        for n, t in q0_parts.items():
            setattr(q0, n, t)
        bias = None
        if ws[0].bias is not None:  # GLM's and gpt-oss's q/k/v biases: one vector, the three re-pointed to views
            with torch.no_grad():
                bias = torch.cat([w.bias for w in ws])
                o = 0
                for w in ws:
                    n = w.bias.shape[0]
                    w.bias = torch.nn.Parameter(bias[o : o + n], requires_grad=False)
                    o += n
        return cls(qw, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.qlinear import gluon_measured_faster, qlinear

        return qlinear(x, self.qw, self.bias, gluon=gluon_chosen(x.device, gluon_measured_faster(x.device)))


class _DenseGEMV(torch.nn.Linear):
    """A plain (bf16) projection of the decode step through qlinear's GEMV on its weight as stored (MODE_DENSE)
    for decode rows (at most GEMV_MAX_M tokens), torch's linear (cuBLAS) for more; the same Parameters as the
    Linear it replaces (no copy), so prefill, the state dict and the plain step see no difference. Why: at batch
    1 cuBLAS runs some projection shapes as a split-K GEMV plus a separate reduce, well under the copy
    bandwidth (benchmarks/bench_dense_gemv.py measures both per shape; the launch config's
    `qlinear.dense_gemv` turns the route on where it measured faster, with its tiles)."""

    def __init__(self, lin: torch.nn.Linear, tiles: dict):
        from ..kernels.dequant import MODE_DENSE, QWeight

        torch.nn.Module.__init__(self)
        # the sizes from the weight: a fused projection (_fuse_linears) is a Linear whose weight was swapped in
        self.out_features, self.in_features = lin.weight.shape
        self.weight, self.bias = lin.weight, lin.bias
        self.qw = QWeight(MODE_DENSE, 16, self.in_features, lin.weight.data[None])
        self.tiles = tiles  # qlinear's gemv overrides: block_o, block_k, num_warps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.qlinear import GEMV_MAX_M, qlinear

        if x.numel() // self.in_features <= GEMV_MAX_M and kernels_enabled(x.device):
            return qlinear(x, self.qw, self.bias, **self.tiles)
        return F.linear(x, self.weight, self.bias)

    def route(self, x: torch.Tensor, spec: dict):
        """(y, weights, ids): this projection of decode rows x whose first spec["experts"] outputs are a router's
        logits, routed in the GEMV's epilogue (qlinear's `route`)."""
        from ..kernels.qlinear import qlinear

        return qlinear(x, self.qw, self.bias, route=spec, **self.tiles)

    def gated(self, gu: torch.Tensor) -> torch.Tensor | None:
        """This projection of silu(g)·u for a fused gate/up output gu = [g | u] (QLinear.gated's contract)."""
        from ..kernels.qlinear import gated_ok, qlinear

        if not kernels_enabled(gu.device) or not gated_ok(self.qw, gu.numel() // gu.shape[-1]):
            return None
        return qlinear(gu, self.qw, self.bias, gated=True, **self.tiles)


def shared_down(w2, gu: torch.Tensor) -> torch.Tensor:
    """A shared expert's down projection of silu(g)·u, gu = [g | u] its fused gate/up output: one launch where w2's
    decode GEMV reads the activation in its loads (_DenseGEMV / QLinear `gated`; MOEC_GATED_DOWN=0 turns it off for
    the A/B), else fused_decode.silu_mul and w2 (two). The same numbers either way (dequant.load_x rounds as
    silu_mul does)."""
    from ..kernels.fused_decode import silu_mul

    gated = getattr(w2, "gated", None)
    if gated is not None and os.environ.get("MOEC_GATED_DOWN", "1") != "0":
        y = gated(gu)
        if y is not None:
            return y
    return w2(silu_mul(gu))


def dense_gemv_chosen(device) -> bool:
    """Whether the fused step sends its plain projections to _DenseGEMV on `device`: MOEC_DENSE_GEMV=1 / 0 forces
    it either way (the A/B of benchmarks), else the launch config's `qlinear.dense_gemv.on` where the kernels
    run."""
    from ..kernels import launch_config

    forced = os.environ.get("MOEC_DENSE_GEMV")
    if forced in ("0", "1"):
        return forced == "1" and kernels_enabled(device)
    return kernels_enabled(device) and torch.device(device).type == "cuda" and bool(
        launch_config.config("qlinear", device)["dense_gemv"]["on"])


class DecodeEngine:
    """Prefill + static decode steps for `batch` rows of up to `max_len` tokens each."""

    def __init__(self, model: Transformer, cache, graphs: bool | None = None, fuse: bool | None = None):
        self.model, self.args, self.cache = model, model.args, cache
        dev = model.tok_embeddings.weight.device
        self.device, self.dtype = dev, model.tok_embeddings.weight.dtype
        B, S = cache.batch, cache.max_len
        assert S <= self.args.max_seq_len, (S, self.args.max_seq_len)
        self.batch, self.max_len = B, S
        cos, sin = rope_cos_sin(self.args, torch.arange(S, device=dev), self.dtype)  # [S, d]
        self.cos, self.sin = cos, sin
        self.tokens = torch.zeros(B, dtype=torch.long, device=dev)  # input of the next step
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)  # its position per row
        self.logits = torch.zeros(B, self.args.vocab_size, dtype=torch.float32, device=dev)
        self.next = torch.zeros(B, dtype=torch.long, device=dev)  # greedy choice of the last step
        cache.pos = self.pos
        self.graphs_on = dev.type == "cuda" if graphs is None else graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_error: str | None = None
        # fused step (moec/kernels/fused_decode.py + one q/k/v projection): wherever the kernels run
        # (backend.kernels_enabled), MOEC_FUSE=0 turns it off (benchmarks/bench_latency.py measures both)
        if fuse is None:
            fuse = kernels_enabled(dev) and os.environ.get("MOEC_FUSE", "1") != "0"
        self.fused = fuse and self.args.qk_norm in ("none", "head") and self.args.clip_qkv is None
        rd = self.args.rope_dim
        self.rope_kernel = rd >= 8 and rd & (rd - 1) == 0  # kernels/fused_decode.qk_norm_rope's rotary widths
        mla = self.args.is_mla  # MLA: the fused residual + norms around its own attention (no q/k/v to fuse)
        # the fused step's MLA prologue kernel (fused_decode.mla_rope_latent) takes power-of-two RoPE widths
        self.mla_kernel = self.fused and mla and rd >= 2 and rd & (rd - 1) == 0
        self.qkv = [self._fuse_linears((blk.attn.wq, blk.attn.wk, blk.attn.wv)) for blk in model.layers] \
            if self.fused and not mla else []
        # the router's rows in the shared expert's gate/up GEMV (one launch a layer fewer; _fuse_shared) where
        # ROUTER_IN_SHARED_DEFAULT or MOEC_ROUTER_IN_SHARED says
        fold = os.environ.get("MOEC_ROUTER_IN_SHARED", "1" if ROUTER_IN_SHARED_DEFAULT else "0") == "1"
        shared = [self._fuse_shared(blk.moe, fold) for blk in model.layers] if self.fused else []
        self.shared_gate_up = [f for f, _ in shared]
        self.router_folded = [e for _, e in shared] or [0] * len(model.layers)  # router rows ahead of gate/up
        # MLA: the query's (wq, or V3's wq_a) and the latent's (wkv_a) projections of the same input as one
        self.mla_in = [self._fuse_linears((blk.attn.wq_a if self.args.q_lora_rank else blk.attn.wq, blk.attn.wkv_a))
                       for blk in model.layers] if self.mla_kernel else []
        if self.fused and dense_gemv_chosen(dev):
            self._route_dense_gemv()
        # a folded router's rows routed in that GEMV's epilogue (qlinear `route`) where the route-in-GEMV switch says:
        # the routing spec a layer, else None
        self.route_in_shared = [
            route_spec(blk.moe) if E and route_in_gemv_on() and isinstance(f, _DenseGEMV) else None
            for blk, f, E in zip(model.layers, self.shared_gate_up or [None] * len(model.layers), self.router_folded,
                                 strict=True)]

    def _route_dense_gemv(self) -> None:
        """The fused step's plain projections (fused q/k/v, o, the MLA query and latent inputs, the shared expert's
        gate/up and down, and where `qlinear.dense_gemv.router` or MOEC_DENSE_GEMV_ROUTER=1 says so the router ahead of
        the routing kernel) as _DenseGEMV; the LM head stays with cuBLAS (it streams near the copy bandwidth)."""
        from ..kernels import launch_config

        cfg = launch_config.config("qlinear", self.device)["dense_gemv"]
        tiles = {k: v for k, v in cfg.items() if k not in ("on", "router", "router_block_o")}
        # the router (decode._route) where the config (benchmarks/studies/fp4h_flip.py) or MOEC_DENSE_GEMV_ROUTER says,
        # in programs of router_block_o rows where set (MOEC_ROUTER_BLOCK_O: the A/B; few rows fill few SMs)
        router = os.environ.get("MOEC_DENSE_GEMV_ROUTER", "1" if cfg.get("router") else "0") == "1"
        rows = os.environ.get("MOEC_ROUTER_BLOCK_O", cfg.get("router_block_o") or tiles["block_o"])
        router_rows = _power_of_two("MOEC_ROUTER_BLOCK_O", rows)

        def dense(lin, tiles=tiles):
            return _DenseGEMV(lin, tiles) if type(lin) is torch.nn.Linear else lin

        self.qkv = [dense(p) for p in self.qkv]
        self.shared_gate_up = [dense(p) for p in self.shared_gate_up]
        self.mla_in = [dense(p) for p in self.mla_in]
        for blk in self.model.layers:
            at = blk.attn
            for name in ("wo", "wq_b") + (() if self.mla_kernel else ("wq", "wk", "wv", "wq_a", "wkv_a")):
                if isinstance(getattr(at, name, None), torch.nn.Module):
                    setattr(at, name, dense(getattr(at, name)))
            shared = getattr(blk.moe, "shared", None)
            if shared is not None and not hasattr(blk.moe, "shared_gate"):
                shared.w2 = dense(shared.w2)
            if router and getattr(blk.moe, "kind", None) == "moe":  # the router GEMV before the routing kernel
                blk.moe.router = dense(blk.moe.router, tiles | {"block_o": router_rows})

    @classmethod
    def _fuse_shared(cls, moe, with_router: bool = False) -> tuple[torch.nn.Module | None, int]:
        """The shared expert's gate and up projections as one (_fuse_linears), for the fused step's three launches
        a layer (gate/up, fused_decode.silu_mul, down; its output added in the next add_rms_norm) instead of
        six (two GEMVs, silu, mul, down, the add); None where there is no shared expert, it is gated
        (Qwen2-MoE's sigmoid gate), the layer is dense, or the two do not fuse. with_router: the router's E rows
        first in the same projection where they fuse (a plain Linear without bias of the experts' dtype, more
        experts than route_gemv_topk takes, routing the kernels do from logits): -> (fused, E), the step then
        routes from its first E outputs (graph_safe_moe logits) instead of a router GEMV launch; (fused, 0)
        otherwise."""
        if getattr(moe, "kind", None) != "moe" or not hasattr(moe, "shared") or hasattr(moe, "shared_gate"):
            return None, 0
        if with_router and _router_folds(moe):
            fused = cls._fuse_linears((moe.router, moe.shared.w1, moe.shared.w3))
            if fused is not None:
                return fused, moe.router.weight.shape[0]
        return cls._fuse_linears((moe.shared.w1, moe.shared.w3)), 0

    @staticmethod
    def _fuse_linears(ws):
        """One projection for several of the same input (q, k, v: [H·d + 2·K·d, D]; a shared expert's gate and
        up) where they are plain Linear layers of one dtype: each becomes a view of the concatenated weight (no
        extra memory); quantized ones of one codec likewise (_QuantQKV); None otherwise."""
        if all(type(w) is QLinear for w in ws):
            return _QuantQKV.fuse(ws)
        if not all(type(w) is torch.nn.Linear for w in ws) or len({w.weight.dtype for w in ws}) != 1:
            return None
        if len({w.bias is None for w in ws}) != 1:
            return None
        with torch.no_grad():
            fused = torch.nn.Linear(1, 1, bias=ws[0].bias is not None, device="meta")
            fused.weight = torch.nn.Parameter(torch.cat([w.weight for w in ws]), requires_grad=False)
            fused.out_features, fused.in_features = fused.weight.shape  # (the meta Linear's were 1, 1)
            if ws[0].bias is not None:
                fused.bias = torch.nn.Parameter(torch.cat([w.bias for w in ws]), requires_grad=False)
            o = 0
            for w in ws:
                n = w.weight.shape[0]
                w.weight = torch.nn.Parameter(fused.weight[o : o + n], requires_grad=False)
                if w.bias is not None:
                    w.bias = torch.nn.Parameter(fused.bias[o : o + n], requires_grad=False)
                o += n
        return fused

    # -- prefill -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, row: int, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [T] token ids into an empty row; returns the logits [V] (fp32) after its last token."""
        T = prompt.numel()
        assert 0 < T < self.max_len, (T, self.max_len)
        m = self.model
        x = m.tok_embeddings(prompt.to(self.device)[None])  # [1, T, D]
        cos, sin = self.cos[:T], self.sin[:T]
        kv: dict[str, torch.Tensor] = {}

        def grab(layer, name, t):
            if name in ("k", "v", "kv_latent"):
                kv[name] = t

        for block in m.layers:
            x = block(x, cos, sin, None, 0, grab)  # causal SDPA over the prompt
            if self.args.is_mla:  # the latent rows [1, T, r + rope]
                self.cache.prefill_row(row, block.layer, kv["kv_latent"][0])
            else:
                self.cache.prefill_row(row, block.layer, kv["k"][0], kv["v"][0])
        self.cache.set_length(row, T)
        logits = m.lm_head(m.norm(x[:, -1:]))[0, 0].float()
        self.pos[row] = T
        self.tokens[row] = logits.argmax()
        self.next[row] = self.tokens[row]  # step(feed_next=True) right after the prefill feeds its greedy choice
        return logits

    # -- decode --------------------------------------------------------------------------------------------

    def _step(self, b: int) -> None:
        """One decode step for rows [0, b): tokens/pos -> logits, next (no host syncs)."""
        begin = getattr(self.cache, "begin_step", None)
        if begin is not None:
            begin(b)
        try:
            self._step_layers(b)
        finally:
            if begin is not None:
                self.cache.end_step()

    def _step_layers(self, b: int) -> None:
        if self.fused:
            return self._step_fused(b)
        m = self.model
        x = m.tok_embeddings(self.tokens[:b, None])  # [b, 1, D]
        pos = self.pos[:b]
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [b, 1, 1, d]
        for blk in m.layers:
            h = blk.attn_norm(x)
            x = x + blk.attn(h, cos, sin, blk.layer, self.cache, 0)
            h = blk.ffn_norm(x)
            x = x + graph_safe_moe(blk.moe, h.view(b, -1), blk.layer).view(b, 1, -1)
        logits = m.lm_head(m.norm(x))[:, 0]  # [b, V]
        self.logits[:b] = logits.float()
        self.next[:b] = logits.argmax(-1)

    def _step_fused(self, b: int) -> None:
        """_step with the batch-1 fusions: residual add + RMSNorm in one kernel (twice per layer), q/k/v
        in one projection, per-head q/k norm + RoPE of q and k in one kernel. Same arithmetic and
        rounding as _step up to fp32 summation order."""
        from ..kernels.fused_decode import add_rms_norm, qk_norm_rope

        m, a = self.model, self.args
        H, K, d = a.n_heads, a.n_kv_heads, a.head_dim
        x = m.tok_embeddings(self.tokens[:b])  # [b, D]
        pos = self.pos[:b]
        cos, sin = self.cos[pos], self.sin[pos]  # [b, d]
        layers = m.layers
        x, h = add_rms_norm(x, None, layers[0].attn_norm.weight, layers[0].attn_norm.eps)
        for i, blk in enumerate(layers):
            at = blk.attn
            if a.is_mla:  # model.MLAttention's absorbed step (its latent cache: runtime/mla.py)
                if self.mla_kernel:  # its norms, RoPEs and latent row fused
                    o = at.decode_fused(h, cos, sin, blk.layer, self.cache, self.mla_in[i])  # [b, D]
                else:
                    o = at(h[:, None], cos[:, None, None], sin[:, None, None], blk.layer, self.cache, 0).view(b, -1)
                x, h = self._moe_residual(i, x, o)
                continue
            if self.qkv[i] is not None:
                qkv = self.qkv[i](h)  # [b, (H + 2K)·d]
                q, k, v = qkv[:, : H * d], qkv[:, H * d : (H + K) * d], qkv[:, (H + K) * d :]
            else:  # projections of different codecs stay separate
                q, k, v = at.wq(h), at.wk(h), at.wv(h)
            norm = a.qk_norm == "head"
            if self.rope_kernel:  # whole heads, or GLM-4.5's partial rotary (its other dims pass through)
                q, k = qk_norm_rope(q, k, cos, sin, H, K, at.q_norm.weight if norm else None,
                                    at.k_norm.weight if norm else None, at.q_norm.eps if norm else 1e-6)
            else:  # a rotary width the kernel does not take: the model's own norm and RoPE
                q, k = q.reshape(b, H, d), k.reshape(b, K, d)
                if norm:
                    q, k = at.q_norm(q), at.k_norm(k)
                q, k = apply_rope(q[:, :, None], cos[:, None, None], sin[:, None, None])[:, :, 0], \
                    apply_rope(k[:, :, None], cos[:, None, None], sin[:, None, None])[:, :, 0]
            sinks = {"sinks": at.sinks} if a.attn_sinks else {}  # gpt-oss
            o = self.cache.attend(blk.layer, q[:, :, None], k[:, :, None], v.reshape(b, K, 1, d), 0, **sinks)
            x, h = self._moe_residual(i, x, at.wo(o.reshape(b, H * d)))
        logits = m.lm_head(h)  # [b, V]
        self.logits[:b] = logits.float()
        self.next[:b] = logits.argmax(-1)

    def _moe_residual(self, i: int, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention output o added to the residual x, its FFN norm, the MoE on it added in turn, and the
        next norm: (x', h')."""
        from ..kernels.fused_decode import add_rms_norm
        from ..kernels.qlinear import GEMV_MAX_M

        m = self.model
        blk = m.layers[i]
        x, h = add_rms_norm(x, o, blk.ffn_norm.weight, blk.ffn_norm.eps)
        nxt = m.layers[i + 1].attn_norm if i + 1 < len(m.layers) else m.norm
        gate_up, E = self.shared_gate_up[i], self.router_folded[i]
        gu = logits = routed = None
        if gate_up is not None and E and self.route_in_shared[i] and h.shape[0] <= GEMV_MAX_M:
            gu, w, ids = gate_up.route(h, self.route_in_shared[i])  # the router's rows routed in its epilogue
            gu, routed = gu[:, E:], (w, ids)
        elif gate_up is not None:
            gu = gate_up(h)
            if E:  # [router logits | gate | up]: the routing kernels read the first E
                logits, gu = gu[:, :E], gu[:, E:]
        # the routed output may come in fp32: add_rms_norm rounds each delta to x's dtype first, as the plain step's
        # MoE output is rounded before its add
        y = graph_safe_moe(blk.moe, h, blk.layer, shared=gate_up is None, exact_dtype=False, logits=logits,
                           routed=routed)
        if gate_up is None:
            return add_rms_norm(x, y, nxt.weight, nxt.eps)
        return add_rms_norm(x, y, nxt.weight, nxt.eps, delta2=shared_down(blk.moe.shared.w2, gu))

    def _capture(self, b: int) -> torch.cuda.CUDAGraph | None:
        pos0 = self.pos.clone()
        saved = [t.clone() for t in (self.tokens, self.logits, self.next)]
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._step(b)  # warm-up (autotuning, lazy init) outside the capture
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step(b)
        except Exception as e:  # a path that syncs cannot be captured: run eagerly, and say why
            self.graph_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("CUDA graph capture failed (%s); decoding eagerly", self.graph_error)
            self.graphs_on = False
            g = None
        # the warm-up wrote this step's K/V at pos (the real step overwrites them); restore the rest
        self.pos.copy_(pos0)
        for t, v in zip((self.tokens, self.logits, self.next), saved, strict=True):
            t.copy_(v)
        return g

    @torch.no_grad()
    def step(self, b: int | None = None, feed_next: bool = False) -> torch.Tensor:
        """Decode one token for rows [0, b); `self.tokens` is the input (or, feed_next, the last
        greedy choice). Returns logits [b, V] fp32 (a view of the static buffer)."""
        b = self.batch if b is None else b
        if feed_next:
            self.tokens[:b] = self.next[:b]
        for r in range(b):
            assert self.cache.length[r] < self.max_len, f"row {r} is full ({self.max_len} tokens)"
        if self.graphs_on:
            nb = bucket_for(b, self.batch)
            if nb not in self.graphs:
                g = self._capture(nb)
                if g is not None:
                    self.graphs[nb] = g
            if self.graphs_on:
                self.graphs[nb].replay()
        if not self.graphs_on:
            self._step(b)
        self.pos[:b] += 1
        self.cache.after_step(range(b))
        return self.logits[:b]

    def replay(self, b: int) -> None:
        """Timing only: replay the captured step for bucket b without advancing any state."""
        self.graphs[bucket_for(b, self.batch)].replay()


# -- construction ---------------------------------------------------------------------------------------

def make_cache(model: Transformer, batch: int, max_len: int, kv: dict | None = None, codecs: list | None = None,
               use_kernel: bool | None = None):
    """The static cache for a block codec's KV section (None: fp16), from its per-layer codecs; ValueError
    for codecs with a cache of their own (static_cache_factory builds those)."""
    dev = model.tok_embeddings.weight.device
    if not kv:
        return dense_cache(model.args, batch, max_len, device=dev, mode="static")
    from .kvtiered import tiered_cache_factory
    from .loader import kv_codec_spec

    if not kv_codec_spec(kv).tiered:
        raise ValueError(f"static engine has no {kv['codec']!r} cache")
    return tiered_cache_factory(kv, codecs, mode="static", use_kernel=use_kernel)(model, batch, max_len)


def static_cache_factory(kv: dict | None, tensors: dict[str, torch.Tensor], args: ModelArgs):
    """(model, batch, max_len) -> the static cache for a checkpoint's KV section (None: fp16): the codec
    family's cache in static mode (moec/runtime/kvcache.py), by the codec's registered spec: TieredKVCache
    for block codecs, the codec's `cache_factory` hook otherwise. Checks the calibration against the model
    once, here (FormatError)."""
    if not kv:
        return lambda model, batch, max_len: make_cache(model, batch, max_len)
    from .loader import kv_codec_spec

    spec = kv_codec_spec(kv)
    if spec.tiered:
        from .kvtiered import build_codecs

        codecs = build_codecs(kv, tensors, args)
        return lambda model, batch, max_len: make_cache(model, batch, max_len, kv, codecs)
    if spec.cache_factory is None:
        raise ValueError(f"static engine has no {kv['codec']!r} cache")
    return spec.hook("cache_factory")(kv, tensors, args, mode="static")


@torch.no_grad()
def evaluate_dec(model: Transformer, windows: torch.Tensor, cache_fn, batch_size: int = 4,
                 baseline_logits=None) -> dict:
    """ppl_dec by the docs/benchmarks.md protocol through the static engine (prefill CONTEXT tokens, then one
    token at a time, teacher forced). cache_fn(batch, max_len) -> static cache."""
    from .perplexity import CONTEXT, Totals

    n, W = windows.shape
    tot = Totals()
    dev = model.tok_embeddings.weight.device
    for s in range(0, n, batch_size):
        batch = windows[s : s + batch_size].to(dev)
        B = batch.shape[0]
        eng = DecodeEngine(model, cache_fn(B, W))
        first = torch.stack([eng.prefill(r, batch[r, :CONTEXT]) for r in range(B)])
        tot.add(first, batch[:, CONTEXT], None)
        for t in range(CONTEXT, W - 1):
            eng.tokens[:B] = batch[:, t]
            logits = eng.step(B)
            tot.add(logits, batch[:, t + 1], None)
    out = tot.result(False)
    out["windows"], out["window_len"] = n, W
    return out
