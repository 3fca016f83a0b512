"""A moec packed checkpoint as a transformers model: the quantizer transformers dispatches to for
`quant_method: "moec"`, and `from_pretrained` for checkpoints transformers cannot open by itself.

Shape legend: E = experts, I = expert intermediate size, D = model dim, N = tokens, A = experts per token.

Both paths end in `attach_packed(model, PACKED_DIR)`: moec's runtime loader reads and checks the checkpoint
(runtime/loader.load_state: version, hashes, shapes, the parts each codec stores), the kept tensors become
the transformers parameters (canonical names mapped back onto transformers' in-memory names, experts
fused into `gate_up_proj [E, 2I, D]` and `down_proj [E, D, I]` as transformers 5 holds them), and each
quantized matrix is served by moec's own runtime modules: `MoecExperts` / `MoecMLP` wrap
runtime/experts.ExpertWeights (Triton kernels on CUDA, the torch reference elsewhere) and quantized
attention projections, shared-expert matrices and the LM head become runtime/experts.QLinear. A quantized
router is held dequantized, as the runtime holds it (experts.attach); nothing else is dequantized here.

Why the quantizer loads in its after-load hook: the shards hold moec's canonical names and codec parts
(`layers.0.moe.w1.codes`), not transformers' names, so transformers' own loader finds none of its
parameters there; the hook then fills every one of them from moec's loader (the keys transformers reports
as missing/unexpected are expected, and silenced). `AutoModelForCausalLM.from_pretrained` needs the
checkpoint's `model.safetensors.index.json` (written by `moec pack` since it was added to the format);
`from_pretrained` below also reads checkpoints packed before it, building the model from its config.

Why a model_type of moec's own: a packed directory's config.json says `model_type:
formats/checkpoint.MODEL_TYPE` (the source's kept under SOURCE_MODEL_TYPE), so that transformers without moec
refuses it, quoting that model_type, which names moec and the fix, where the source's model_type would give
a randomly initialised model with warnings only (the `moec` quant_method unknown, every tensor missing).
Importing this module registers MoecPackedConfig for it, whose `from_dict` returns the source architecture's
own config class, so any architecture transformers knows loads (nothing per architecture is registered).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import FormatError
from ..formats import checkpoint
from ..rotation import rotate
from ..runtime.experts import HEAD_PARAM, ExpertWeights, QLinear, QuantMatrix, pop_quant_experts
from ..runtime.hf_layout import MLA_LINEARS, MLA_NORMS, SHARED_EXPERTS_ARCHS
from ..runtime.loader import check_state_shapes, load_state
from ..runtime.model import combine_experts
from . import generic

QUANT_METHOD = "moec"
_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"} | MLA_LINEARS
# canonical per-layer names -> transformers' (the in-memory names of Llama, Mixtral, Qwen2/3-MoE, OLMoE in
# transformers 5: every MoE block is `mlp` with `gate`, `experts` and the shared expert beside them)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
    "moe.router.weight": "mlp.gate.weight", "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
    **{f"moe.shared.{c}.weight": f"mlp.shared_expert.{h}.weight"
       for c, h in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
    **{f"attn.{c}.{s}": f"self_attn.{h}.{s}" for c, h in _ATTN.items() for s in ("weight", "bias")},
    **{f"attn.{c}.weight": f"self_attn.{h}.weight" for c, h in MLA_NORMS.items()},
    "moe.score_bias": "mlp.gate.e_score_correction_bias",
    "attn.sinks": "self_attn.sinks", "moe.router.bias": "mlp.gate.bias",
}


def _layer_name(args, canonical: str) -> str:
    """transformers' name of a canonical per-layer tensor (DeepSeek and GLM-4.5 call theirs `shared_experts`,
    gpt-oss its router `router`)."""
    h = _LAYER_NAMES[canonical]
    if args.arch == "gpt_oss":
        return h.replace("mlp.gate.", "mlp.router.")
    return h.replace("mlp.shared_expert.", "mlp.shared_experts.") if args.arch in SHARED_EXPERTS_ARCHS else h


class MoecExperts(nn.Module):
    """Stands in for transformers' fused experts module (forward(x [N, D], top_k_index, top_k_weights [N, A])
    -> [N, D]): moec's ExpertWeights, through the fused Triton MoE kernels where they apply (CUDA), else the
    runtime's reference combine (model.combine_experts over ExpertWeights.expert)."""

    def __init__(self, codec: ExpertWeights, args=None, biases=None):
        super().__init__()
        self.codec, self.args = codec, args
        if biases is not None:  # gpt-oss's expert biases (b1, b3 [E, I], b2 [E, D])
            for n, b in zip(("b1", "b3", "b2"), biases, strict=True):
                self.register_buffer(n, b)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        biases = (self.b1, self.b3, self.b2) if hasattr(self, "b1") else None
        out = self.codec.fused(hidden_states, top_k_weights, top_k_index, self.args, biases)
        if out is None:
            out = combine_experts(lambda e, x: self.codec.expert(e, x, self.args, biases), hidden_states,
                                  top_k_weights, top_k_index)
        return out


class MoecMLP(nn.Module):
    """Stands in for a dense MLP (gate/up/down) whose matrices moec quantized: one always-taken expert, as
    moec's runtime runs it (model.MoE, kind dense)."""

    def __init__(self, codec: ExpertWeights):
        super().__init__()
        self.codec = codec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.expert(0, x.reshape(-1, x.shape[-1])).view(x.shape)


def hf_tensors(args, state: dict[str, torch.Tensor], quantized_layers: set[int]) -> dict[str, torch.Tensor]:
    """transformers' parameter names -> tensors, from moec's canonical kept tensors. Experts of the layers in
    `quantized_layers` are left out (MoecExperts / MoecMLP hold them, kept matrices included)."""
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(args.n_layers):
        p, m = f"layers.{i}.", f"model.layers.{i}."
        out.update({m + _layer_name(args, c): state[p + c] for c in _LAYER_NAMES if p + c in state})
        if i in quantized_layers:
            continue
        w1, w3, w2 = (state[f"{p}moe.{c}"] for c in ("w1", "w3", "w2"))  # [E, I, D] ×2, [E, D, I]
        if args.ffn_kinds[i] == "dense":
            out.update({m + "mlp.gate_proj.weight": w1[0], m + "mlp.up_proj.weight": w3[0],
                        m + "mlp.down_proj.weight": w2[0]})
        elif args.arch == "gpt_oss":  # inputs first, gate and up interleaved along the outputs, biases beside
            E, I, D = w1.shape
            b1, b3, b2 = (state[f"{p}moe.{c}"] for c in ("b1", "b3", "b2"))
            out.update({m + "mlp.experts.gate_up_proj": torch.stack([w1, w3], dim=2).reshape(E, 2 * I, D).mT,
                        m + "mlp.experts.gate_up_proj_bias": torch.stack([b1, b3], dim=2).reshape(E, 2 * I),
                        m + "mlp.experts.down_proj": w2.mT, m + "mlp.experts.down_proj_bias": b2})
        else:  # transformers 5 fuses gate (first I rows) and up
            out.update({m + "mlp.experts.gate_up_proj": torch.cat([w1, w3], dim=1), m + "mlp.experts.down_proj": w2})
    return out


def attach_packed(model: nn.Module, path: str | Path) -> nn.Module:
    """Fill a transformers model of the checkpoint's architecture from moec packed checkpoint `path`: kept
    tensors as its parameters (in the model's dtype, on its device), quantized matrices as moec runtime
    modules. FormatError when the checkpoint and the model disagree (the first mismatch named)."""
    path = Path(path)
    args, state, info = load_state(path)
    quant = pop_quant_experts(state, info["manifest"])
    check_state_shapes(path, args, {n: t.shape for n, t in state.items()} |
                       {p: torch.Size(q.param_shape) for p, q in quant.items()})
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    layers = model.model.layers
    by_layer: dict[int, dict[str, QuantMatrix]] = {}
    for p, q in quant.items():
        if HEAD_PARAM.search(p):  # the LM head (a tied source was packed untied: config.json says so)
            model.lm_head = QLinear(q.to(device), None)
            continue
        i, rest = int(p.split(".")[1]), p.split(".", 2)[2]  # layers.<i>.<rest>
        if rest.startswith("attn."):  # attn.w[qkvo].weight
            c = rest.split(".")[1]
            bias = state.get(f"layers.{i}.attn.{c}.bias")
            setattr(layers[i].self_attn, _ATTN[c],
                    QLinear(q.to(device), None if bias is None else bias.to(device, dtype)))
        elif rest.startswith("moe.shared."):  # moe.shared.w[123].weight
            mod, attr = _module_attr(model, f"model.layers.{i}.{_layer_name(args, rest).removesuffix('.weight')}")
            setattr(mod, attr, QLinear(q.to(device), None))
        elif rest == "moe.router.weight":  # held dequantized, as the runtime holds it (experts.attach)
            w = q.dequant_ref(0)
            state[p] = rotate(w, q.had_signs, q.had_h, inverse=True) if q.rotated else w
        else:
            by_layer.setdefault(i, {})[rest.rsplit(".", 1)[-1]] = q
    for i, qs in by_layer.items():
        ws = [qs[c].to(device) if c in qs else state[f"layers.{i}.moe.{c}"].to(device, dtype)
              for c in ("w1", "w3", "w2")]
        if args.ffn_kinds[i] == "dense":
            layers[i].mlp = MoecMLP(ExpertWeights(*ws))
        else:
            b = [state.get(f"layers.{i}.moe.{c}") for c in ("b1", "b3", "b2")]
            layers[i].mlp.experts = MoecExperts(ExpertWeights(*ws), args,
                                                None if b[0] is None else [t.to(device, dtype) for t in b])
    # what a moec module holds (experts, MLPs, quantized linears with their biases) is neither wanted nor offered
    want = {n: t for n, t in model.state_dict().items() if not _held(model, n)}
    got = {n: t for n, t in hf_tensors(args, state, set(by_layer)).items() if not _held(model, n)}
    tied = getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in got
    if tied:
        want.pop("lm_head.weight", None)
    for name in [*want, *sorted(got.keys() - want.keys())]:
        if name not in got:
            raise FormatError(f"{path}: no tensor for transformers parameter {name!r}")
        if name not in want:
            raise FormatError(f"{path}: tensor for {name!r}, which the transformers model does not have")
        if got[name].shape != want[name].shape:
            raise FormatError(f"{path}: {name!r} has shape {list(got[name].shape)}, transformers wants "
                              f"{list(want[name].shape)}")
        mod, attr = _module_attr(model, name)
        setattr(mod, attr, nn.Parameter(got[name].to(device, dtype), requires_grad=False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _module_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod, _, attr = name.rpartition(".")
    return model.get_submodule(mod), attr


def _owners(model: nn.Module, name: str):
    """The modules along a parameter's dotted path."""
    parts = name.split(".")
    for j in range(1, len(parts)):
        yield model.get_submodule(".".join(parts[:j]))


def _held(model: nn.Module, name: str) -> bool:
    """Whether a moec module (MoecExperts, MoecMLP, QLinear) on the path of parameter `name` holds it (a QLinear
    takes its bias with its quantized weight); False for a path the model does not have (reported as extra)."""
    try:
        return any(isinstance(mod, (MoecExperts, MoecMLP, QLinear)) for mod in _owners(model, name))
    except AttributeError:
        return False


class MoecPackedConfig(PreTrainedConfig):
    """The config of a moec packed directory as AutoConfig reads it once moec.hf is imported: `from_dict`
    returns the source architecture's own config (model_type from SOURCE_MODEL_TYPE, quantization_config
    kept so that transformers dispatches to MoecHfQuantizer), so AutoModelForCausalLM picks that
    architecture's model class."""

    model_type = checkpoint.MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        source = config_dict.get(checkpoint.SOURCE_MODEL_TYPE)
        if source not in CONFIG_MAPPING:
            raise ValueError(f"moec packed checkpoint of model_type {source!r}, which this transformers version "
                             f"does not know")
        cfg = {k: v for k, v in config_dict.items() if k != checkpoint.SOURCE_MODEL_TYPE} | {"model_type": source}
        return CONFIG_MAPPING[source].from_dict(cfg, **kwargs)


AutoConfig.register(checkpoint.MODEL_TYPE, MoecPackedConfig, exist_ok=True)


@register_quantization_config(QUANT_METHOD)
class MoecConfig(QuantizationConfigMixin):
    """config.json's `quantization_config` as `moec pack` writes it (formats/checkpoint.quantization_config, a
    mirror of the manifest's recipe): the format and the recipe's rules, for display; what is loaded comes
    from the manifest (moec.json)."""

    def __init__(self, format: str = checkpoint.FORMAT, format_version: int = checkpoint.FORMAT_VERSION,
                 config_groups: dict | None = None, kv_cache_scheme: dict | None = None, ignore: list | None = None,
                 w_bits: float | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format, self.format_version = format, format_version
        self.config_groups, self.kv_cache_scheme = config_groups or {}, kv_cache_scheme
        self.ignore, self.w_bits = ignore or [], w_bits
        for k, v in kwargs.items():  # keys a later moec writes: kept, so the config round-trips
            setattr(self, k, v)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@register_quantizer(QUANT_METHOD)
class MoecHfQuantizer(HfQuantizer):
    """Loads a moec packed checkpoint (pre-quantized only): see the module docstring."""

    requires_calibration = True

    def validate_environment(self, *args, **kwargs):
        if not self.pre_quantized:
            raise ValueError("moec quantizes offline (`moec calibrate` + `moec pack`); load a packed checkpoint")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise ValueError("moec: no checkpoint files (a packed checkpoint directory has a "
                             f"{checkpoint.HF_INDEX})")
        self.path = Path(checkpoint_files[0]).parent
        # transformers' loader matches none of the canonical names: every key is expected to miss (filled below)
        model._keys_to_ignore_on_load_unexpected = {r".*"}
        model._keys_to_ignore_on_load_missing = {r".*"}
        # nor the tied embeddings (transformers would warn that the checkpoint looks corrupted): attach_packed
        # ties them, and the mapping is restored for what reads it later (saving, resizing embeddings)
        self.tied = getattr(model, "all_tied_weights_keys", None)
        if self.tied is not None:
            model.all_tied_weights_keys = {}
        manifest = checkpoint.read_manifest(self.path)
        if not generic.is_generic(manifest) or manifest.get("kv"):  # weight-only generic packs: the model's own
            use_moec_attention(model)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.tied is not None:
            model.all_tied_weights_keys = self.tied
        manifest = checkpoint.read_manifest(self.path)
        if generic.is_generic(manifest):  # layout "hf": transformers' own names (hf/generic.py)
            return generic.attach_generic(model, self.path)
        return attach_packed(model, self.path)

    def is_serializable(self):
        return False  # `moec pack` writes the format; save_pretrained would write transformers' names

    @property
    def is_trainable(self):
        return False


def use_moec_attention(model) -> None:
    """Attend through moec.hf.cache.moec_attention (SDPA, plus the history score bias a MoecCache asks for)."""
    from .cache import ATTENTION

    model.config._attn_implementation = ATTENTION
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION


def from_pretrained(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers model of moec packed checkpoint `path` on `device`, computing in `dtype` (fp32: the
    CPU reference), for any packed checkpoint, those packed before `model.safetensors.index.json` was
    written included: built from its config.json (random init, then every tensor replaced) and filled by
    `attach_packed`. `AutoModelForCausalLM.from_pretrained(path)` gives the same model where the index exists."""
    path = Path(path)
    manifest = checkpoint.read_manifest(path)  # a clear FormatError before transformers reads anything
    cfg = checkpoint.source_hf_config(json.loads((path / "config.json").read_text()))
    config = AutoConfig.for_model(**cfg)
    if generic.is_generic(manifest):
        from .stream import params_on_meta

        with params_on_meta():  # every parameter is replaced from the pack: none is allocated twice
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if manifest.get("kv"):  # a KV codec: MoecCache's history attention (cache.py)
            use_moec_attention(model)
        return generic.attach_generic(model, path).to(device).eval()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    use_moec_attention(model)
    return attach_packed(model, path).to(device).eval()
