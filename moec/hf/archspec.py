"""ArchSpec: what each decoder layer of a transformers causal LM is, read from its modules and config.

No list of model types: a type is described because its modules say what they are.

- **Experts**: the modules that transformers' `use_experts_implementation` decorator marked (they carry
  `has_gate`, `is_transposed`, `is_concatenated`, `has_bias`), and undecorated stacked experts (llama4's
  `Llama4TextExperts`) recognised by the decorator's parameter names, 3-D `gate_up_proj` / `down_proj`.
- **Router**: beside the experts (in the experts' parent, the MoE block), the child holding a weight of
  `[n_experts (+1), hidden]`, or else the child with a `top_k` attribute (a router that is an MLP of its
  own: zaya). Its score function, renormalisation and internal scaling come from running a random CPU copy
  of it on random tokens and matching the weights it returns against softmax / sigmoid / sqrt-softplus of
  the logits it returns; a router whose outputs are not (logits, weights, indices) (llama4, phimoe's
  sparsemixer, deepseek_v4's hash router) falls back to the config's `scoring_func` and the score calls in
  its source. Score-correction bias, group-limited top-k and routed scaling come from its attributes and
  the config.
- **Shared experts / dense MLP**: modules that are only linear maps hidden → I → hidden (two or more
  `nn.Linear`, or stacked 3-D weights), among the MoE block's children and the layer's; in a layer with
  experts they are shared experts, in one without, the dense MLP.
- **Attention**: the outermost module of the layer with `num_key_value_groups` (every transformers module
  that goes through `AttentionInterface` has it); MLA when it holds `kv_a_proj_with_mqa`; sliding from its
  `sliding_window` / `is_sliding` or the config's `layer_types`; sinks from a parameter named `*sinks*`. A
  layer with no such module holds a linear-attention / state-space / convolution mixer ("linear"), or no
  token mixer at all ("none", nemotron_h's MoE-only and MLP-only blocks). A `layer_types` entry other than
  full / sliding / chunked (compressed, hybrid, sparse-indexed attention) makes the layer "other".

    spec = arch_spec_from_config(tiny_config("deepseek_v3"))   # built on the meta device
    spec.layers[0].ffn, spec.layers[1].router.score            # "dense", "sigmoid"
    spec.kv_refusal()                                          # "layer 0: mla attention ..."
    groups = param_groups(model, arch_spec(model))             # parameter name -> recipe target group
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

KV_HOLDS = ("full",)  # the attention kinds whose K/V moec's KV codecs hold
NO_KV = ("none",)  # layers without a token mixer: nothing to hold
_FULL_TYPES = {"full_attention", "attention", "global_attention", "global"}
_LINEAR_TYPES = {"linear_attention", "mamba", "conv", "ssm", "recurrent"}
_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
_SCALE_NAME = re.compile(r"rout.*scal|scal.*rout")  # routed_scaling_factor, route_scale, router_scaling_factor


@dataclass(frozen=True)
class RouterSpec:
    score: str  # "softmax" | "sigmoid" | "sqrtsoftplus" | another score function's name, as found
    top_k: int
    n_experts: int
    bias: bool  # score-correction bias (e_score_correction_bias, expert_bias, ...) present
    n_group: int | None  # group-limited top-k: number of groups (None: not group-limited)
    topk_group: int | None  # groups kept
    scaling: float | None  # routed scaling factor (None: none found)
    renormalize: bool  # top-k weights renormalised to sum to 1 (norm_topk_prob)
    module: str = ""  # dotted path of the router module inside the decoder layer, e.g. "mlp.gate"
    probed: bool = False  # score / renormalize / scaling measured by running the router (else from config/source)


@dataclass(frozen=True)
class ExpertsSpec:
    module: str  # dotted path of the experts module inside a decoder layer, e.g. "mlp.experts"
    gate_up: str  # "gate_up_proj", or "up_proj" when has_gate is False
    down: str
    is_transposed: bool  # weights stored [E, in, out] (gpt_oss, llama4) rather than [E, out, in]
    is_concatenated: bool  # gate and up halves stacked (else interleaved)
    has_bias: bool
    has_gate: bool
    decorated: bool  # False for llama4's plain Llama4TextExperts
    n_experts: int
    intermediate: int
    custom_gate: bool = False  # the class defines its own `_apply_gate` (gpt_oss: clamped SwiGLU)


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: str  # "full" | "sliding" | "chunked" | "mla" | "linear" | "other" | "none"
    window: int | None  # sliding window (or attention chunk) size
    sinks: bool  # learned attention sinks (gpt_oss)
    ffn: str  # "moe" | "dense" | "none"
    experts: ExpertsSpec | None
    router: RouterSpec | None
    shared_experts: int  # shared-expert MLP modules (a DeepSeek block of n × I counts as one); 0 when none
    attention_module: str | None  # dotted path, e.g. "self_attn"; the mixer's path for "linear"
    layer_type: str | None = None  # the config's layer_types entry, as written there
    shared_modules: tuple[str, ...] = ()  # dotted paths of the shared-expert MLPs
    mlp_module: str | None = None  # dotted path of the dense MLP (ffn "dense")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layers: tuple[LayerSpec, ...]
    layers_path: str  # e.g. "model.layers"
    engine: bool  # moec's own engine implements the type (moec/runtime/hf_layout.py SUPPORTED)
    hidden: int = 0

    def kv_refusal(self) -> str | None:
        """One line naming the first layer whose attention moec's KV codecs cannot hold, or None."""
        for layer in self.layers:
            if layer.attention in NO_KV:
                continue
            why = None
            if layer.attention not in KV_HOLDS:
                detail = {"mla": "its cache is the MLA latent, not per-head K/V",
                          "linear": "it keeps a recurrent state, not K/V",
                          "sliding": f"a sliding window of {layer.window} tokens",
                          "chunked": f"attention in chunks of {layer.window} tokens",
                          "other": f"layer type {layer.layer_type!r}"}.get(layer.attention, layer.attention)
                why = f"{layer.attention} attention ({detail})"
            elif layer.sinks:
                why = "attention with learned sinks"
            if why:
                return (f"{self.model_type} layer {layer.index} ({layer.attention_module}): {why} cannot be held "
                        f"by moec's KV codecs; use a recipe without `kv:` (expert and linear rules still apply)")
        return None

    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.ffn == "moe")


# ---- module tests -----------------------------------------------------------------------------------


def _is_experts(mod: nn.Module) -> bool:
    if hasattr(mod, "has_gate") and hasattr(mod, "is_transposed"):
        return True
    # undecorated stacked experts (llama4): the decorator's parameter names, 3-D, more than one expert
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and gu.shape[0] == down.shape[0] > 1)


def _experts_spec(path: str, mod: nn.Module, hidden: int) -> ExpertsSpec:
    decorated = hasattr(mod, "has_gate") and hasattr(mod, "is_transposed")
    has_gate = bool(mod.has_gate) if decorated else hasattr(mod, "gate_up_proj")
    gate_up = "gate_up_proj" if has_gate else "up_proj"
    gu, down = getattr(mod, gate_up), mod.down_proj
    if decorated:
        transposed = bool(mod.is_transposed)
    else:  # [E, hidden, out] is input-major (llama4); [E, out, hidden] is the decorator's default
        transposed = gu.shape[1] == hidden and gu.shape[2] != hidden
    intermediate = down.shape[1] if transposed else down.shape[2]
    return ExpertsSpec(
        module=path, gate_up=gate_up, down="down_proj", is_transposed=transposed,
        is_concatenated=bool(getattr(mod, "is_concatenated", True)),
        has_bias=bool(mod.has_bias) if decorated else hasattr(mod, f"{gate_up}_bias"),
        has_gate=has_gate, decorated=decorated, n_experts=int(gu.shape[0]), intermediate=int(intermediate),
        custom_gate=decorated and _custom_gate(type(mod)))


def _custom_gate(cls) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return getattr(cls, "_apply_gate", _default_apply_gate) is not _default_apply_gate


def _is_attention(mod: nn.Module) -> bool:
    return hasattr(mod, "num_key_value_groups")


def _weights(mod: nn.Module) -> list[torch.Tensor]:
    return [p for p in mod.parameters(recurse=False) if p.dim() >= 2]


def _is_mlp(mod: nn.Module, hidden: int) -> bool:
    """Only linear maps in and out of the hidden size: ≥ 2 nn.Linear children (nothing else with parameters),
    or stacked ≥ 2-D weights held directly; one reads hidden, one writes it."""
    if _is_experts(mod) or _is_attention(mod):
        return False
    holders = [m for m in mod.modules() if any(True for _ in m.parameters(recurse=False))]
    if not holders:
        return False
    if holders == [mod]:
        mats = _weights(mod)
        if len(mats) < 2 or len(mats) != len(list(mod.parameters(recurse=False))):
            return False
        return any(w.shape[-1] == hidden for w in mats) and any(w.shape[-2] == hidden for w in mats)
    if not all(isinstance(m, nn.Linear) for m in holders) or len(holders) < 2:
        return False
    return (any(m.in_features == hidden for m in holders) and any(m.out_features == hidden for m in holders))


def _holds(mod: nn.Module, pred) -> bool:
    return any(pred(m) for m in mod.modules())


# ---- the router ---------------------------------------------------------------------------------------


def _find_router(scope: nn.Module, skip: set[int], n_experts: int, hidden: int) -> tuple[str, nn.Module] | None:
    """The child of `scope` that routes: it holds a [n_experts (+1 for a skip/sink class), hidden] weight,
    or (a router that is an MLP of its own) has a `top_k` attribute and ≥ 2-D weights."""
    kids = [(n, c) for n, c in scope.named_children() if id(c) not in skip]
    # a child with `top_k` first, then one named router / gate: gemma4's layer (the MoE scope there) also
    # holds other [hidden_per_layer, hidden] projections
    kids.sort(key=lambda nc: (not hasattr(nc[1], "top_k"), nc[0] not in ("router", "gate")))
    for name, child in kids:
        for m in child.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == hidden and \
                    w.shape[0] in (n_experts, n_experts + 1):
                return name, child
    for name, child in kids:
        if hasattr(child, "top_k") and any(p.dim() >= 2 for p in child.parameters()):
            return name, child
    return None


@functools.cache
def _source(cls) -> str:
    try:
        return textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return ""


@functools.cache
def _calls(cls) -> tuple[str, ...]:
    """Names of the functions called in a class's methods, in source order (comments and strings excluded)."""
    try:
        tree = ast.parse(_source(cls))
    except SyntaxError:
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name:
                out.append((node.lineno, node.col_offset, name))
    return tuple(n for _, _, n in sorted(out))


def _score_from_source(router: nn.Module, block: nn.Module) -> str:
    """The score function a router's (then its MoE block's) code calls; else a function of the modeling
    module it calls (phimoe: sparsemixer); else "other"."""
    for cls in (type(router), type(block)):
        calls = _calls(cls)
        softplus = "softplus" in calls
        for name in calls:
            if name in ("softmax", "sigmoid"):
                return name
        if softplus:
            return "sqrtsoftplus" if "sqrt" in calls else "softplus"
    module = inspect.getmodule(type(router))
    for name in _calls(type(router)):
        if module is not None and inspect.isfunction(getattr(module, name, None)) and \
                getattr(module, name).__module__ == module.__name__:
            return name
    return "other"


def _score_fns(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    x = logits.float()
    return {"softmax": x.softmax(-1), "sigmoid": x.sigmoid(), "sqrtsoftplus": nn.functional.softplus(x).sqrt()}


def _probe(router: nn.Module, hidden: int, n_experts: int) -> tuple[str, bool, float] | None:
    """Run a random CPU copy of `router` on random tokens; when it returns (logits, weights, indices), the
    (score, renormalize, scale) that reproduce the weights from the logits on most tokens; else None."""
    gen = torch.Generator().manual_seed(0)
    try:
        r = copy.deepcopy(router).to_empty(device="cpu").float().eval()
    except Exception:  # a router that cannot be copied or moved is read from its source instead
        return None
    with torch.no_grad():
        for t in list(r.parameters()) + list(r.buffers()):
            if t.is_floating_point():  # logits of order one: peaked ones would make every score look alike
                scale = t.shape[-1] ** -0.5 if t.dim() >= 2 else 0.1
                t.copy_(torch.randn(t.shape, generator=gen) * scale)
            else:
                t.copy_(torch.randint(0, n_experts, t.shape, generator=gen))
        x = torch.randn(16, hidden, generator=gen)
        # routers that take the MoE block's score-correction bias as an argument (minimax_m2, hy_v3, afmoe; lfm2
        # with a None default): called without it, then with a random one
        params = list(inspect.signature(r.forward).parameters.values())[1:]
        required = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is inspect.Parameter.empty]
        optional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is None]
        bias = [torch.randn(n_experts, generator=gen) * 0.1 for _ in range(len(required) + len(optional))]
        out = None
        for inp in (x, x[None]):
            for extra in (bias[:len(required)], bias):
                try:
                    out = r(inp, *extra)
                    break
                except Exception:  # noqa: PERF203 - a router that wants [B, T, H] (zaya) or its bias is called again
                    continue
            if out is not None:
                break
    if not isinstance(out, tuple):
        return None
    ts = [t.reshape(16, -1) for t in out if isinstance(t, torch.Tensor) and t.numel() % 16 == 0 and t.dim() >= 1]
    idx = next((t for t in ts if not t.is_floating_point()), None)
    logits = next((t for t in ts if t.is_floating_point() and t.shape[1] in (n_experts, n_experts + 1)), None)
    if idx is None or logits is None:
        return None
    weights = next((t for t in ts if t.is_floating_point() and t.shape == idx.shape), None)
    if weights is None:
        return None
    w, k = weights.float(), idx.shape[1]
    best = None  # (fraction of rows matched, score, renormalize, scale)
    for renorm in (False, True):
        for score, s in _score_fns(logits).items():
            g = s.gather(-1, idx.long())
            if renorm:
                g = g / g.sum(-1, keepdim=True)
            c = float((w * g).sum() / (g * g).sum().clamp_min(1e-30))
            rows = float(torch.isclose(w, c * g, rtol=1e-4, atol=1e-6).all(-1).float().mean())
            if c > 0 and (best is None or rows > best[0]):
                best = (rows, score, renorm, c)
    # a skip class (zaya) zeroes the weight of the rows that chose it: most rows, not all, must match
    if best is None or best[0] < 0.75 or (k == 1 and best[2]):  # one expert renormalised: every score fits
        return None
    return best[1:]


def _attr(mods, names):
    for m in mods:
        for n in names:
            v = getattr(m, n, None)
            if v is not None and not isinstance(v, (nn.Module, torch.Tensor)):
                return v
    return None


def _router_spec(path: str, router: nn.Module, block: nn.Module, config, n_experts: int, hidden: int,
                 cache: dict) -> RouterSpec:
    key = type(router)
    if key not in cache:
        cache[key] = _probe(router, hidden, n_experts)
    probed = cache[key]
    mods = (router, block)
    top_k = _attr(mods, ("top_k",)) or getattr(config, "num_experts_per_tok", None) or \
        getattr(config, "top_k_experts", None)
    bias = any(t.numel() in (n_experts, n_experts + 1) and "bias" in n.split(".")[-1]
               and n.split(".")[-1] != "bias"
               for m in mods for n, t in list(m.named_parameters(recurse=m is router))
               + list(m.named_buffers(recurse=m is router)))
    n_group = _attr(mods, ("n_group", "num_group", "num_expert_group"))
    topk_group = _attr(mods, ("topk_group",))
    if n_group is None:
        n_group = getattr(config, "n_group", None)
        topk_group = topk_group if topk_group is not None else getattr(config, "topk_group", None)
    method = _attr(mods, ("topk_method",))
    # deepseek_v2's router takes groups only under topk_method "group_limited_greedy"
    if (method is not None and "group" not in str(method)) or not n_group or n_group <= 1:
        n_group = topk_group = None
    scale_attr = next((getattr(m, n) for m in mods for n in vars(m) if _SCALE_NAME.search(n)
                       and isinstance(getattr(m, n), (int, float)) and not isinstance(getattr(m, n), bool)), None)
    if scale_attr is None:
        scale_attr = next((v for n, v in config.to_dict().items() if _SCALE_NAME.search(n)
                           and isinstance(v, (int, float)) and not isinstance(v, bool)), None)
    if probed is not None:
        score, renorm, c = probed
        if abs(c - 1.0) <= 1e-4:  # no scaling inside the router: the block's or the config's, if any
            scaling = float(scale_attr) if scale_attr is not None else None
        else:  # the attribute it came from, where one matches the measured factor
            scaling = float(scale_attr) if scale_attr is not None and abs(scale_attr - c) <= 1e-4 * c \
                else round(c, 6)
    else:
        score = next((str(v).lower().replace("_", "") for n, v in config.to_dict().items()
                      if n in ("scoring_func", "score_func", "expert_selection_fn") and v), None)
        score = score or _score_from_source(router, block)
        norm = _attr(mods, ("norm_topk_prob", "renormalize"))
        if norm is None:
            norm = getattr(config, "norm_topk_prob", None)
        if norm is None:
            norm = bool(re.search(r"/=?\s*\(?[\w.\[\]]*\.sum\(", _source(type(router))))
        renorm = bool(norm)
        scaling = float(scale_attr) if scale_attr is not None else None
    return RouterSpec(score=score, top_k=int(top_k), n_experts=n_experts, bias=bias,
                      n_group=int(n_group) if n_group else None, topk_group=int(topk_group) if topk_group else None,
                      scaling=scaling, renormalize=renorm, module=path, probed=probed is not None)


# ---- one layer ------------------------------------------------------------------------------------


def _layer_type(config, i: int) -> str | None:
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and i < len(types) and isinstance(types[i], str):
        return types[i]
    return None


def _int(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _layer_spec(i: int, layer: nn.Module, config, hidden: int, cache: dict) -> LayerSpec:
    named = dict(layer.named_modules())
    lt = _layer_type(config, i)

    # experts, their MoE block, its router and shared experts
    ex_path = next((n for n, m in named.items() if n and _is_experts(m)), None)
    experts = router = None
    shared: list[str] = []
    if ex_path is not None:
        experts = _experts_spec(ex_path, named[ex_path], hidden)
        block_path = ex_path.rpartition(".")[0]
        block = named[block_path]
        skip = {id(named[ex_path])}
        found = _find_router(block, skip, experts.n_experts, hidden)
        if found is not None:
            rname, rmod = found
            rpath = f"{block_path}.{rname}" if block_path else rname
            skip.add(id(rmod))
            router = _router_spec(rpath, rmod, block, config, experts.n_experts, hidden, cache)
        scopes = [(block_path, block)] + ([("", layer)] if block_path else [])
        for spath, scope in scopes:
            for n, c in scope.named_children():
                if id(c) not in skip and c is not block and _is_mlp(c, hidden):
                    shared.append(f"{spath}.{n}" if spath else n)

    # the token mixer
    attn_path = next((n for n, m in named.items() if n and _is_attention(m)), None)
    mlp_path = None
    if experts is None:
        mlp_path = next((n for n, c in layer.named_children() if _is_mlp(c, hidden)), None)
    ffn = "moe" if experts is not None else "dense" if mlp_path is not None else "none"
    window, sinks = None, False
    if attn_path is None:
        taken = {ex_path.split(".")[0] if ex_path else None, mlp_path, *(s.split(".")[0] for s in shared)}
        mixer = next((n for n, c in layer.named_children() if n not in taken and not _holds(c, _is_experts)
                      and any(p.dim() >= 2 for p in c.parameters())), None)
        kind, attn_path = ("linear", mixer) if mixer is not None else ("none", None)
    else:
        mod = named[attn_path]
        sinks = any("sink" in n for n, _ in list(mod.named_parameters(recurse=False))
                    + list(mod.named_buffers(recurse=False)))
        sliding = _int(getattr(mod, "sliding_window", None))
        if getattr(mod, "is_sliding", None) is False:
            sliding = None
        if any(n.split(".")[-1] == "kv_a_proj_with_mqa" for n, _ in mod.named_modules()):
            kind = "mla"
        elif lt is not None and lt in _LINEAR_TYPES:
            kind = "linear"
        elif lt is not None and "chunk" in lt:
            kind, window = "chunked", _int(getattr(config, "attention_chunk_size", None))
        elif lt is not None and lt not in _FULL_TYPES and "sliding" != lt.replace("_attention", ""):
            kind, window = "other", sliding
        elif sliding is not None or (lt is not None and "sliding" in lt):
            kind = "sliding"
            window = sliding or _int(getattr(config, "sliding_window", None))
        else:
            kind = "full"
    return LayerSpec(index=i, attention=kind, window=window, sinks=sinks, ffn=ffn, experts=experts, router=router,
                     shared_experts=len(shared), attention_module=attn_path, layer_type=lt,
                     shared_modules=tuple(shared), mlp_module=mlp_path)


# ---- the model ------------------------------------------------------------------------------------


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layers(model: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers and name:
            return name, mod
    raise AssertionError(f"{type(model).__name__}: no ModuleList of {n_layers} decoder layers")


def arch_spec(model: nn.Module) -> ArchSpec:
    """The ArchSpec of an instantiated transformers causal LM (any device, the meta device included)."""
    from ..runtime.hf_layout import SUPPORTED

    config = _text_config(model.config)
    types = getattr(config, "layer_types", None)
    n_layers = len(types) if isinstance(types, (list, tuple)) and config.num_hidden_layers is None \
        else config.num_hidden_layers
    path, layers = _layers(model, n_layers)
    hidden = int(config.hidden_size)
    cache: dict = {}
    specs = tuple(_layer_spec(i, layer, config, hidden, cache) for i, layer in enumerate(layers))
    return ArchSpec(model_type=model.config.model_type, layers=specs, layers_path=path,
                    engine=model.config.model_type in SUPPORTED, hidden=hidden)


def arch_spec_from_config(config) -> ArchSpec:
    """Builds the model on the meta device (no memory, no init) and reads its ArchSpec."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return arch_spec(model)


# ---- parameter groups -----------------------------------------------------------------------------

GROUPS = ("experts", "shared_experts", "mlp", "attention", "router", "lm_head", "other")


def _under(rest: str, path: str | None) -> bool:
    return bool(path) and (rest == path or rest.startswith(path + "."))


def param_groups(model: nn.Module, spec: ArchSpec) -> dict[str, str]:
    """Every parameter name of the model → one recipe target group (`moec/formats/codecs.py` TARGET_PATTERNS):
    experts (every parameter of an experts module, biases included), shared_experts / mlp / attention / router
    (their ≥ 2-D weight matrices; attention: the nn.Linear children of a softmax or MLA attention module),
    lm_head (the output embedding, unless tied), other (embeddings, norms, biases, sinks, linear-attention and
    indexer internals, ...)."""
    modules = dict(model.named_modules())
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = {id(p) for p in out_emb.parameters()} if out_emb is not None else set()
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(p) for p in in_emb.parameters()} if in_emb is not None else set()
    groups = {}
    prefix = spec.layers_path + "."
    for name, p in model.named_parameters():
        group = "other"
        if name.startswith(prefix):
            idx, _, rest = name[len(prefix):].partition(".")
            layer = spec.layers[int(idx)]
            owner_path, _, leaf = rest.rpartition(".")
            if layer.experts and _under(rest, layer.experts.module):
                group = "experts"
            elif p.dim() < 2:
                group = "other"
            elif layer.router and _under(rest, layer.router.module):
                group = "router" if "weight" in leaf else "other"  # ernie's [1, E] score-correction bias
            elif any(_under(rest, s) for s in layer.shared_modules):
                group = "shared_experts"
            elif _under(rest, layer.mlp_module):
                group = "mlp"
            elif layer.attention not in ("linear", "none") and layer.attention_module and \
                    owner_path.rpartition(".")[0] == layer.attention_module and leaf == "weight" and \
                    isinstance(modules[f"{prefix}{idx}.{owner_path}"], nn.Linear):
                group = "attention"
        elif id(p) in head and id(p) not in tied:
            group = "lm_head"
        groups[name] = group
    return groups
