"""The transformers path: a packed checkpoint of layout "hf" (any MoE transformers runs, including those moec's
engine does not implement) executed inside transformers' own modeling code.

Shape legend: E = experts, O = output rows, I = inputs, N = tokens, A = experts per token.

Layout "hf" (manifest `"layout": "hf"`, no `model_args`; config.json is the source config plus the
`quantization_config`): tensors are named by the transformers model's in-memory parameter names
(`model.layers.0.mlp.experts.gate_up_proj`, `model.layers.0.self_attn.q_proj.weight`, ...). Kept tensors are
stored exactly as transformers holds them. A quantized matrix `P` is stored as the parts `P.<part>` of its codec
(formats/codecs.py), always with rows = output channels: an expert stack as [E, O, I] (gate_up as one stack
[E, 2I, D]: concatenated or interleaved gate/up rows are all rows to a row codec), a linear weight as [O, I]. An
expert stack that transformers holds transposed ([E, I, O]: `is_transposed`, gpt_oss) is transposed before it is
quantized; the manifest's `hf.transposed` lists those parameters.

Execution (`attach_generic`): kept tensors become the model's parameters; a quantized expert stack lives in its
experts module as a runtime/experts.QuantMatrix (`moec_stacks`), and that module (only it) dispatches through
the experts implementation "moec" registered here (`ALL_EXPERTS_FUNCTIONS`): per hit expert, its gate_up (or
up) rows dequantized (QuantMatrix.dequant_ref), bias added where the module has one, the module's own
`_apply_gate` (gpt_oss's clamped SwiGLU) or `act_fn`, then down; a stack fitted with incoherence (stored W·R
with its `had_signs`) reads its input rotated (QuantMatrix.rotate_input). Quantized linear weights (attention
projections, dense and shared MLPs, the LM head) become runtime/experts.QLinear modules (which rotate their input
likewise); a quantized router is held dequantized, its rotation undone (as the engine holds it), and computed by
the model's own router code. Attention is the model's own unless the checkpoint has a KV codec (cache.MoecCache,
moec_attention).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from ..errors import FormatError
from ..formats import checkpoint
from ..registry import stored_as_is
from ..rotation import rotate
from ..runtime.experts import QLinear, QuantMatrix

LAYOUT = "hf"
EXPERTS_IMPL = "moec"
GROUPS = ("experts", "shared_experts", "mlp", "attention", "router", "lm_head", "other")


# -- what a transformers model holds ------------------------------------------------------------------------

def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{module path: module} of the experts modules: those decorated with `use_experts_implementation` (the
    decorator sets has_gate / is_transposed / has_bias on every instance), and plain stacked experts without it
    (llama4's Llama4TextExperts: 3-D `gate_up_proj` and `down_proj`, every token routed to every expert with its
    router score already applied), which get the same attributes here (`moec_plain` marks them)."""
    out = {}
    for n, m in model.named_modules():
        if "down_proj" not in m._parameters:
            continue
        if hasattr(m, "is_transposed") and hasattr(m, "has_gate"):
            out[n] = m
        elif getattr(m._parameters.get("gate_up_proj"), "dim", lambda: 0)() == 3 and m.down_proj.dim() == 3:
            gu, dn = m.gate_up_proj.shape, m.down_proj.shape
            m.is_transposed = gu[2] == 2 * dn[1]  # [E, D, 2I] and [E, I, D] (llama4) rather than [E, 2I, D], [E, D, I]
            m.has_gate, m.has_bias, m.is_concatenated, m.moec_plain = True, False, True, True
            if not hasattr(m, "num_experts"):
                m.num_experts = gu[0]
            out[n] = m
    return out


def stack_params(mod: nn.Module) -> tuple[str, str]:
    """The quantizable stacks of an experts module: (gate_up_proj or up_proj, down_proj)."""
    return ("gate_up_proj" if mod.has_gate else "up_proj", "down_proj")


def rows(mod: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """An expert stack as [E, O, I] (rows = outputs), from transformers' layout."""
    return t.transpose(-1, -2) if mod.is_transposed else t


def _groups_fallback(model: nn.Module) -> dict[str, str]:
    """param -> group from module structure (used until moec.hf.archspec.param_groups is present)."""
    experts = experts_modules(model)
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        mod = name.rpartition(".")[0]
        if name.startswith("lm_head."):
            g = "lm_head"
        elif any(mod == e or mod.startswith(e + ".") for e in experts):
            g = "experts"
        elif re.search(r"\.shared_experts?\.|\.shared_mlp\.", name):
            g = "shared_experts"
        elif re.search(r"\.(self_attn|attn|attention|linear_attn|self_attention)\.", name):
            g = "attention"
        elif re.search(r"\.mlp\.(gate|router)\.weight$", name) or re.search(r"\.router\.weight$", name):
            g = "router"
        elif re.search(r"\.mlp\.", name):
            g = "mlp"
        else:
            g = "other"
        out[name] = g
    return out


def param_groups(model: nn.Module) -> dict[str, str]:
    """{param name: target group} (GROUPS) of a transformers model: moec.hf.archspec's where present."""
    try:
        from .archspec import arch_spec
        from .archspec import param_groups as groups
    except ImportError:
        return _groups_fallback(model)
    return groups(model, arch_spec(model))


def quantizable(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{param name: shape as stored when quantized} of the matrices a weight codec may take: expert stacks
    [E, O, I], nn.Linear weights [O, I] and routers' weights [E, D]."""
    out: dict[str, tuple[int, ...]] = {}
    for path, mod in experts_modules(model).items():
        for p in stack_params(mod):
            out[f"{path}.{p}"] = tuple(rows(mod, getattr(mod, p)).shape)
    groups = param_groups(model)
    for path, mod in model.named_modules():
        w = mod._parameters.get("weight")
        if w is None or w.dim() != 2:
            continue
        name = f"{path}.weight"
        if _plain_linear(mod) or groups.get(name) == "router":
            out[name] = tuple(w.shape)
    return out


def _plain_linear(mod: nn.Module) -> bool:
    """An nn.Linear computing F.linear (a subclass with its own forward is not replaced by QLinear)."""
    return isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward


def rule_for(recipe, name: str, group: str):
    """The first recipe rule selecting parameter `name` of target group `group` (a named target selects its
    group, a regex target the name), None: kept. The transformers-path counterpart of Recipe.rule_for."""
    from ..formats.codecs import TARGET_PATTERNS

    for rule in recipe.weights:
        for t in rule.targets:
            if (t == group) if t in TARGET_PATTERNS else re.search(t, name):
                return rule
    return None


def tied_names(model: nn.Module) -> set[str]:
    """Parameters that are tied to another one (not stored: the LM head of a tied model)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return set()
    return set(tied)


# -- execution -----------------------------------------------------------------------------------------------

class MoecStacks(nn.Module):
    """The quantized stacks of one experts module, each a QuantMatrix [E, O, I]."""

    def __init__(self, stacks: dict[str, QuantMatrix]):
        super().__init__()
        for k, q in stacks.items():
            self.add_module(k, q)


def _weight(mod: nn.Module, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix `name` as [O, I] in dtype: dequantized when moec holds it, else transformers' param."""
    stacks = getattr(mod, "moec_stacks", None)
    if stacks is not None and name in stacks._modules:
        return stacks._modules[name].dequant_ref(e, dtype)
    w = getattr(mod, name)[e]
    return (w.t() if mod.is_transposed else w).to(dtype)


def _input(mod: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """x [n, I] in the basis stack `name` reads: x·R where moec holds it fitted with incoherence (W·R stored,
    QuantMatrix.rotate_input), else x."""
    stacks = getattr(mod, "moec_stacks", None)
    if stacks is not None and name in stacks._modules:
        return stacks._modules[name].rotate_input(x)
    return x


def moec_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts implementation "moec": x [N, D], top_k_index / top_k_weights [N, A] -> [N, D], each hit expert's
    matrices dequantized once (QuantMatrix.dequant_ref), the module's bias, gate and activation honoured; a stack
    fitted with incoherence reads its input rotated (x·R for gate_up, the gate's output h·R for down), the
    rotation shared by the layer's experts, so x is rotated once per call."""
    up, down = stack_params(self)
    out = torch.zeros_like(hidden_states)
    dt = hidden_states.dtype
    xr = _input(self, up, hidden_states)  # [N, D]
    for e in top_k_index.unique().tolist():
        if e < 0 or e >= self.num_experts:  # expert-parallel sentinels
            continue
        tok, pos = torch.where(top_k_index == e)
        h = xr[tok] @ _weight(self, up, e, dt).t()  # [n, 2I] (or [n, I] without a gate)
        if self.has_bias:
            h = h + getattr(self, up + "_bias")[e].to(dt)
        h = apply_gate(self, h) if self.has_gate else self.act_fn(h)
        y = _input(self, down, h) @ _weight(self, down, e, dt).t()  # [n, D]
        if self.has_bias:
            y = y + self.down_proj_bias[e].to(dt)
        out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def apply_gate(mod: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The module's own gate (`_apply_gate`: gpt_oss's clamped SwiGLU), or transformers' default (act(gate) * up)."""
    if hasattr(mod, "_apply_gate"):
        return mod._apply_gate(h)
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate(mod, h)


def _plain_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A plain stacked-experts module's forward (x [E·N, D]: every token for every expert, router score applied)
    through the experts implementation in `self.moec_impl`: row r goes to expert r // N, a zero row (a token the
    router did not pick for that expert) to no expert."""
    E = self.num_experts
    N = hidden_states.shape[0] // E
    idx = torch.arange(E, device=hidden_states.device).repeat_interleave(N)[:, None]  # [E·N, 1]
    idx = torch.where(hidden_states.abs().amax(-1, keepdim=True) > 0, idx, E)
    return self.moec_impl(self, hidden_states, idx, torch.ones(idx.shape, dtype=hidden_states.dtype,
                                                                device=idx.device))


def dispatch_experts(mod: nn.Module, implementation: str):
    """Route this experts module (only it) through `implementation`; returns a callable that undoes it. A
    decorated module's forward reads `self.config._experts_implementation`: the module gets its own shallow copy
    of the config. A plain one (moec_plain) gets an instance forward calling the registered function."""
    if getattr(mod, "moec_plain", False):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        mod.moec_impl = ALL_EXPERTS_FUNCTIONS[implementation]
        mod.forward = _plain_forward.__get__(mod)

        def undo():
            del mod.forward, mod.moec_impl

        return undo
    old = mod.config
    cfg = copy.copy(old)
    cfg._experts_implementation_internal = implementation
    mod.config = cfg

    def undo():
        mod.config = old

    return undo


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, moec_experts_forward)


_register()


def is_generic(manifest: dict) -> bool:
    return manifest.get("layout") == LAYOUT


def attach_generic(model: nn.Module, path, manifest: dict | None = None) -> nn.Module:
    """Fill transformers model `model` (of the pack's config) from packed checkpoint `path` of layout "hf":
    kept tensors as its parameters (in the model's dtype, on its device), quantized matrices as moec modules
    (module docstring). FormatError naming the first tensor the model and the checkpoint disagree on."""
    manifest = manifest or checkpoint.verify(path)
    names = [n for n in manifest["tensors"] if not n.startswith("kv.")]
    tensors = checkpoint.load_tensors(path, manifest, names)
    first = next(model.parameters())
    device = torch.device("cpu") if first.is_meta else first.device  # a model built on meta: the CPU
    dtype = first.dtype
    transposed = set((manifest.get("hf") or {}).get("transposed", []))
    quant: dict[str, dict] = {}
    kept: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        e = manifest["tensors"][n]
        if stored_as_is(e["codec"]):
            kept[n] = t
        else:
            quant.setdefault(e["param"], {"entry": e, "parts": {}})["parts"][n.removeprefix(e["param"] + ".")] = t
    experts = experts_modules(model)
    want = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict())  # parameters and persistent buffers (a router's score-correction bias)
    tied = tied_names(model)
    for p, v in quant.items():
        e = v["entry"]
        if p not in want:
            raise FormatError(f"{path}: quantized {p!r} is not a parameter of the transformers model")
        q = QuantMatrix(e["codec"], e["bits"], tuple(e["param_shape"]), v["parts"]).to(device)
        mod_path, _, attr = p.rpartition(".")
        mod = model.get_submodule(mod_path)
        if mod_path in experts:
            expect = tuple(rows(mod, want[p]).shape)
            if tuple(q.shape) != expect or (p in transposed) != bool(mod.is_transposed):
                raise FormatError(f"{path}: {p!r} is stored {list(q.shape)} (transposed: {p in transposed}), the "
                                  f"model holds {list(want[p].shape)} (transposed: {bool(mod.is_transposed)})")
            del mod._parameters[attr]
            stacks = getattr(mod, "moec_stacks", None) or MoecStacks({})
            stacks.add_module(attr, q)
            mod.moec_stacks = stacks
            dispatch_experts(mod, EXPERTS_IMPL)
        elif _plain_linear(mod):
            if (q.shape[1], q.shape[2]) != tuple(want[p].shape):
                raise FormatError(f"{path}: {p!r} is stored {list(q.shape[1:])}, the model holds "
                                  f"{list(want[p].shape)}")
            parent_path, _, child = mod_path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            bias = None if mod.bias is None else mod.bias
            setattr(parent, child, QLinear(q, bias))
        else:  # a router's weight: held dequantized (its rotation undone), computed by the model's own router
            kept[p] = unrotated(q, q.dequant_ref(0))
    want = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]
            if n in persistent and (n not in quant or n in kept)}
    for name in [*want, *sorted(kept.keys() - want.keys())]:
        if name not in kept:
            if name in tied:
                continue
            raise FormatError(f"{path}: no tensor for transformers parameter {name!r}")
        if name not in want:
            raise FormatError(f"{path}: tensor for {name!r}, which the transformers model does not have")
        if kept[name].shape != want[name].shape:
            raise FormatError(f"{path}: {name!r} has shape {list(kept[name].shape)}, transformers wants "
                              f"{list(want[name].shape)}")
        mod_path, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_path) if mod_path else model
        if attr in mod._buffers:
            mod._buffers[attr] = kept[name].to(device, dtype if kept[name].is_floating_point() else None)
        else:
            mod._parameters[attr] = nn.Parameter(kept[name].to(device, dtype), requires_grad=False)
    if tied:
        model.tie_weights()
    return model


def unrotated(q: QuantMatrix, w: torch.Tensor) -> torch.Tensor:
    """W [..., O, I] from q's dequantized W·R (incoherence: W = (W·R)·Rᵀ), or w itself when q is not rotated."""
    return rotate(w, q.had_signs, q.had_h, inverse=True) if q.rotated else w


def dequantized_reference(source: nn.Module, packed: nn.Module, manifest: dict) -> nn.Module:
    """A copy of transformers model `source` with every matrix the pack quantized replaced by its dequantized
    value, run by transformers' own code: what `packed` (attach_generic of that pack) must compute."""
    ref = type(source)(source.config).eval()
    ref.load_state_dict(source.state_dict())
    experts = experts_modules(ref)
    for name in {e["param"] for n, e in manifest["tensors"].items()
                 if not stored_as_is(e["codec"]) and not n.startswith("kv.")}:  # kv.*: the KV codec's, not weights
        mod_path, _, attr = name.rpartition(".")
        mod = packed.get_submodule(mod_path)
        if mod_path in experts:
            q = getattr(mod.moec_stacks, attr)
            w = rows(experts[mod_path], unrotated(q, q.dequant_ref()))  # back to transformers' layout
        elif isinstance(mod, QLinear):
            w = unrotated(mod.q, mod.q.dequant_ref(0))
        else:  # a router held dequantized
            w = getattr(mod, attr)
        ref.get_parameter(name).data.copy_(w)
    return ref


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: attention module} of the modules that go through transformers' AttentionInterface (they carry
    `num_key_value_groups` and `layer_idx`)."""
    return {m.layer_idx: m for m in model.modules()
            if hasattr(m, "num_key_value_groups") and isinstance(getattr(m, "layer_idx", None), int)}


def kv_args(model: nn.Module):
    """The attention shapes moec's KV codecs and caches read (runtime/config.ModelArgs: n_layers, n_kv_heads,
    head_dim, max_seq_len; no FFN), from the transformers config: stored as the manifest's `hf.kv_args`."""
    from ..runtime.config import ModelArgs

    c = model.config.get_text_config()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return ModelArgs(arch=c.model_type, vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
                     n_heads=heads, n_kv_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=head_dim,
                     max_seq_len=getattr(c, "max_position_embeddings", 4096), n_experts=0, ffn_kinds=[])
