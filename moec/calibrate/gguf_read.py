"""Read a GGUF file exactly, or refuse it in one line (no silent failure).

transformers' GGUF loader builds a model from the metadata and fills it with the tensors it recognises:
a tensor it does not map is dropped and the parameter it should have filled keeps its random init. A
llama-architecture GGUF with experts (Mixtral as llama.cpp stores it, and moec's own exports,
moec/export/to_gguf.py) became a dense Llama that way. So moec first lists what the file holds
(`inspect`, gguf-py's reader: metadata and tensor names only) and refuses, naming it, an architecture or a
tensor it does not map exactly. Then:

- dense `llama`: transformers' loader, as before (every tensor of the file is one it maps);
- `llama` with experts (→ `mixtral`), `qwen2moe` (→ `qwen2_moe`), `qwen3moe` (→ `qwen3_moe`): read here
  (`write_moe_hf`), each tensor dequantized by gguf-py's own `gguf.quants.dequantize` (the reference
  llama.cpp's Python package ships), q/k rows of a llama GGUF un-permuted from GGML's interleaved RoPE
  pairs back to HF's rotate-half order (the inverse of llama.cpp's converter, and of
  export/to_gguf.permute_rope_rows), written as an HF directory in the on-disk layout (per-expert
  tensors), whose every tensor shape moec's runtime then checks against the config;
- `deepseek2` (→ deepseek_v2 / deepseek_v3) and `gpt-oss` (→ gpt_oss), types of moec's transformers path:
  gguf_generic.py, checked by transformers' own loading report.

Name map (GGUF per-layer `blk.{i}.NAME` → HF `model.layers.{i}.NAME`): `_LAYER` below.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import FormatError, UserError
from . import gguf_generic

# general.architecture -> (HF model_type, dense HF model_type or None if the file must have experts)
ARCHS = {"llama": ("mixtral", "llama"), "qwen2moe": ("qwen2_moe", None), "qwen3moe": ("qwen3_moe", None)}
_GLOBAL, _BLK = gguf_generic.GLOBAL, gguf_generic.BLK  # global tensor names; a per-layer name's block and rest
_ATTN = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight"}
_DENSE = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_EXPERTS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# per architecture: {GGUF per-layer name: HF per-layer name}; experts (stacked in GGUF) are mapped apart
_LAYER = {
    "llama": _ATTN | _DENSE,
    "mixtral": _ATTN,
    "qwen2_moe": _ATTN | _DENSE | {
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"},
    "qwen3_moe": _ATTN | _DENSE | {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                   "attn_k_norm.weight": "self_attn.k_norm.weight"},
}
# HF names of the stacked experts' gate / up / down per expert, and of the router, by model_type
_EXPERT_HF = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
              "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path), "r")
    except Exception as e:  # a truncated or foreign file: gguf-py raises ValueError, struct or numpy errors
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def inspect(path: Path) -> str:
    """The HF model_type moec reads `path` as (UserError, one line, naming the architecture or the first
    tensor it does not map exactly)."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch in gguf_generic.ARCHS:
        gguf_generic.check_tensors(path, reader, arch)
        return gguf_generic.config(path, reader, arch)["model_type"]
    if arch not in ARCHS:
        raise UserError(f"{path.name}: GGUF architecture {arch!r} is not one moec reads exactly "
                        f"(supported: {', '.join((*ARCHS, *gguf_generic.ARCHS))})")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":  # transformers' GGUF config mapping does not carry it: the RoPE would silently change
        raise UserError(f"{path.name}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not one moec reads "
                        f"from a GGUF exactly")
    names = [t.name for t in reader.tensors]
    has_experts = any(_BLK.match(n) and _BLK.match(n).group(2) in _EXPERTS for n in names) \
        or bool(_field(reader, f"{arch}.expert_count", 0))
    moe_type, dense_type = ARCHS[arch]
    model_type = moe_type if has_experts or dense_type is None else dense_type
    known = _LAYER[model_type].keys() | (set(_EXPERTS) if model_type != "llama" else set())
    for n in names:
        m = _BLK.match(n)
        if n not in _GLOBAL and not (m and m.group(2) in known):
            raise UserError(f"{path.name}: tensor {n!r} of GGUF architecture {arch!r} is not one moec maps "
                            f"exactly (read as {model_type}); refusing rather than dropping it")
    return model_type


def has_tokenizer(path: Path) -> bool:
    """Whether the file carries a tokenizer (`tokenizer.ggml.model`); without one, the HF directory has no
    tokenizer files, which whatever needs text then names (sources.load_tokenizer)."""
    return _reader(path).get_field("tokenizer.ggml.model") is not None


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows [n_head·hd, ...] from GGML's interleaved RoPE pairs back to HF's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(path: Path, reader, model_type: str) -> dict:
    """The HF config: transformers' reading of the GGUF metadata, with the expert keys of a llama file
    (which transformers' llama mapping leaves out) and the sizes the tensors fix."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    arch = _field(reader, "general.architecture")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    E = _field(reader, f"{arch}.expert_count")
    A = _field(reader, f"{arch}.expert_used_count")
    if not E or not A:
        raise UserError(f"{path.name}: a GGUF with experts needs {arch}.expert_count and {arch}.expert_used_count")
    gate = next((s for n, s in shapes.items() if n.endswith(".ffn_gate_exps.weight")), None)
    if gate is None:
        raise UserError(f"{path.name}: metadata says {E} experts but no blk.N.ffn_gate_exps tensor is stored")
    cfg["model_type"] = model_type
    cfg["architectures"] = [{"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]]
    cfg["vocab_size"] = shapes["token_embd.weight"][0]
    if model_type == "mixtral":
        cfg.update(num_local_experts=int(E), num_experts_per_tok=int(A), intermediate_size=gate[1])
    else:
        cfg.update(num_experts=int(E), num_experts_per_tok=int(A), moe_intermediate_size=gate[1])
        moe_layers = {int(_BLK.match(n).group(1)) for n in shapes if n.endswith(".ffn_gate_exps.weight")}
        cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if i not in moe_layers]
        cfg["decoder_sparse_step"] = 1
        dense = next((s for n, s in shapes.items() if n.endswith(".ffn_gate.weight")), None)
        if dense is not None:
            cfg["intermediate_size"] = dense[0]
        if model_type == "qwen2_moe":
            shared = next((s for n, s in shapes.items() if n.endswith(".ffn_gate_shexp.weight")), None)
            cfg["shared_expert_intermediate_size"] = shared[0] if shared else 0
            cfg["qkv_bias"] = any(n.endswith(".attn_q.bias") for n in shapes)
    return cfg


def write_moe_hf(path: Path, out: Path) -> dict:
    """Write the MoE GGUF `path` (an `inspect` model_type other than llama) as an HF directory `out`
    (config.json + model.safetensors, fp32); returns the config. UserError where the file and its
    metadata disagree (the first tensor named)."""
    import torch
    from safetensors.torch import save_file

    from ..runtime.hf_layout import HFCheckpoint
    from ..runtime.loader import check_state_shapes

    reader = _reader(path)
    model_type = inspect(path)
    arch = _field(reader, "general.architecture")
    if arch in gguf_generic.ARCHS:  # types of moec's transformers path: transformers' on-disk layout
        return gguf_generic.write_hf(path, reader, arch, out)
    cfg = _config(path, reader, model_type)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    prefix, (g, u, d) = _EXPERT_HF[model_type]
    state: dict[str, torch.Tensor] = {}
    for i, name, w in gguf_generic.dequantized(reader):
        if i is None:  # a global tensor, under its HF name
            state[name] = torch.from_numpy(w.copy())
            continue
        p = f"model.layers.{i}."
        if model_type == "mixtral" and name in ("attn_q.weight", "attn_k.weight"):
            w = unpermute_rope_rows(w, heads if name == "attn_q.weight" else kv_heads)
        if name == "ffn_gate_inp.weight":
            state[f"{p}{prefix}.gate.weight"] = torch.from_numpy(w.copy())  # [E, D]
        elif name in _EXPERTS:  # [E, I, D] gate / up, [E, D, I] down
            h = {"ffn_gate_exps.weight": g, "ffn_up_exps.weight": u, "ffn_down_exps.weight": d}[name]
            for e in range(w.shape[0]):
                state[f"{p}{prefix}.experts.{e}.{h}.weight"] = torch.from_numpy(w[e].copy())
        elif name == "ffn_gate_inp_shexp.weight":  # [D] in GGUF, [1, D] in HF
            state[p + _LAYER[model_type][name]] = torch.from_numpy(w.reshape(1, -1).copy())
        else:
            state[p + _LAYER[model_type][name]] = torch.from_numpy(w.copy())
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    cfg["dtype"] = "float32"
    cfg["moec_source"] = {"gguf": path.name, "read_by": "moec.calibrate.gguf_read"}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    try:  # every tensor the architecture needs is there, with the shape the config implies
        ckpt = HFCheckpoint(out)
        meta = ckpt.meta_state_dict()
        check_state_shapes(out, ckpt.args, {n: v.shape for n, v in meta.items()})
    except (UserError, FormatError) as e:
        raise UserError(f"{path.name}: read as {model_type}, but {str(e).removeprefix(f'{out}: ')}") from None
    unread = sorted(set(state) - _hf_names_read(ckpt))
    if unread:  # e.g. biases the config does not declare: they would be dropped
        raise UserError(f"{path.name}: read as {model_type}, its tensor for {unread[0]!r} is not one that "
                        f"architecture's config uses; refusing rather than dropping it")
    return cfg


def _hf_names_read(ckpt) -> set[str]:
    """The HF tensor names moec's reader takes from `ckpt` (HFCheckpoint), recorded by reading each layer."""
    seen: set[str] = set()
    get = ckpt.get

    def record(name):
        seen.add(name)
        return get(name)

    ckpt.get = record
    try:
        ckpt.meta_state_dict()
    finally:
        del ckpt.get
    return seen
