"""GGUF architectures moec reads into transformers' own model types: `deepseek2` (DeepSeek-V2/V3, Kimi K2,
Moonlight → `deepseek_v2` with softmax routing or `deepseek_v3` with sigmoid routing) and `gpt-oss`
(→ `gpt_oss`). The file is written as an HF directory in transformers' on-disk layout, which both of moec's
paths read (its engine implements these types, runtime/hf_layout.py; its transformers path, moec/hf), and then
checked by transformers itself: loaded on the meta device, any key it reports missing, unexpected or mismatched
refuses the file in one line.

The layout facts (llama.cpp 0.3.36, src/models/deepseek2.cpp and openai-moe.cpp, and the per-tensor shapes
its loader asks for), read as numpy arrays (GGUF dims innermost first, so reversed):

- deepseek2: `attn_kv_a_mqa` [kv_lora + rope, D] and `attn_q_a`/`attn_q_b` (or `attn_q`) are HF's rows as
  they are: llama.cpp ropes them with its NORM (interleaved-pair) type, which is what HF's
  `rope_interleave` (v3) and v2's complex rotation compute, so no row permutation (unlike llama's q/k).
  Current files split HF's `kv_b_proj` per head into `attn_k_b` [H, kv_lora, nope] (transposed) and
  `attn_v_b` [H, v, kv_lora]; legacy files keep `attn_kv_b` [H·(nope + v), kv_lora]. YaRN:
  `rope.scaling.yarn_log_multiplier` stores 0.1 · mscale_all_dim, and llama.cpp computes the softmax scale
  (1 + 0.1 · mscale_all_dim · ln factor)² / sqrt(qk_head_dim) with the rotation's magnitude cancelled, which
  is HF's yarn with mscale == mscale_all_dim (every DeepSeek config has them equal). Gating function 2 is
  sigmoid (→ deepseek_v3, `exp_probs_b` the selection bias, zero where absent as llama.cpp computes it),
  1 or absent softmax (→ deepseek_v2).
- gpt-oss: experts stored apart (`ffn_gate_exps` [E, I, D], `ffn_up_exps`, `ffn_down_exps` [E, D, I] and
  their biases); HF interleaves gate and up in `gate_up_proj` [E, D, 2I] (gate at even columns). NEOX
  rotation (HF's rotate-half): no permutation. Sliding window on the layers the pattern says (llama.cpp's
  default: every other layer, the first one sliding). YaRN: the file does not say HF's `truncate`; the
  model's own (OpenAI's) is False, and that is what is written. llama.cpp floors and ceils YaRN's
  correction range whatever the file says, so its gpt-oss RoPE differs slightly from the model's own
  (measured in benchmarks/studies/gguf_read_llamacpp.py).

A fused `ffn_gate_up_exps`, `attn_qkv`, multi-token-prediction (`nextn`) tensors and any other tensor not in
the maps below are refused, naming the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..errors import UserError

BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_DENSE = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")

# per-layer GGUF name -> HF name, for tensors copied as they are (after dequantization)
LAYER = {
    "deepseek2": _NORMS | _DENSE | {
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        **{f"ffn_{h}_shexp.weight": f"mlp.shared_experts.{h}_proj.weight" for h in ("gate", "up", "down")}},
    "gpt-oss": {
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        **{f"attn_{g}.{s}": f"self_attn.{h}_proj.{s}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                   ("output", "o")) for s in ("weight", "bias")},
        "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias"},
}
# tensors mapped by code below (split, joined or interleaved)
SPECIAL = {"deepseek2": set(_EXPERT_STACKS) | {"attn_k_b.weight", "attn_v_b.weight"},
           "gpt-oss": set(_EXPERT_STACKS) | {f"{n}.bias" for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}}
ARCHS = tuple(LAYER)


def _field(reader, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def dequantized(reader):
    """(layer, name, fp32 numpy array in HF dimension order) for every tensor of the file, each dequantized
    by gguf-py's own `dequantize` (the reference llama.cpp's Python package ships): layer None and the HF
    name for the global tensors, else the block index and the GGUF per-layer name."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(s) for s in reversed(t.shape.tolist())))  # GGUF dims are innermost first
        m = BLK.match(t.name)
        yield (None, GLOBAL[t.name], w) if m is None else (int(m.group(1)), m.group(2), w)


def check_tensors(path: Path, reader, arch: str) -> None:
    """UserError (one line) for the first tensor this module does not map."""
    known = LAYER[arch].keys() | SPECIAL[arch]
    for t in reader.tensors:
        m = BLK.match(t.name)
        if t.name not in GLOBAL and not (m and m.group(2) in known):
            raise UserError(f"{path.name}: tensor {t.name!r} of GGUF architecture {arch!r} is not one moec maps "
                            f"exactly; refusing rather than dropping it")


def _shapes(reader) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def _need(path: Path, reader, arch: str, key: str):
    v = _field(reader, f"{arch}.{key}")
    if v is None:
        raise UserError(f"{path.name}: GGUF metadata {arch}.{key} is missing")
    return v


def _yarn(path: Path, reader, arch: str) -> dict | None:
    """HF rope_parameters for the file's RoPE scaling (None: no scaling); UserError for what is not mapped."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise UserError(f"{path.name}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not one moec reads "
                        f"from a {arch} GGUF exactly")
    p = {"rope_type": "yarn", "factor": float(_need(path, reader, arch, "rope.scaling.factor")),
         "original_max_position_embeddings": int(_need(path, reader, arch, "rope.scaling.original_context_length")),
         "beta_fast": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
         "beta_slow": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0))}
    for key in ("yarn_ext_factor", "yarn_attn_factor", "attn_factor"):
        if _field(reader, f"{arch}.rope.scaling.{key}") is not None:
            raise UserError(f"{path.name}: {arch}.rope.scaling.{key} is not one moec reads from a GGUF exactly")
    return p


def config(path: Path, reader, arch: str) -> dict:
    """The HF config.json of the file, from its metadata and the sizes its tensors fix."""
    shapes = _shapes(reader)
    f = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    need = lambda key: _need(path, reader, arch, key)  # noqa: E731
    heads = int(need("attention.head_count"))
    cfg = {"vocab_size": shapes["token_embd.weight"][0], "hidden_size": int(need("embedding_length")),
           "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
           "max_position_embeddings": int(need("context_length")),
           "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
           "num_experts_per_tok": int(need("expert_used_count")),
           "tie_word_embeddings": "output.weight" not in shapes, "dtype": "float32"}
    theta = float(f("rope.freq_base", 10000.0))
    rope = _yarn(path, reader, arch)
    E = int(need("expert_count"))
    if arch == "deepseek2":
        rot = int(need("rope.dimension_count"))
        if f("attention.key_length_mla") is not None:  # MLA file: key/value_length describe the latent
            k_len, v_len = int(f("attention.key_length_mla")), int(need("attention.value_length_mla"))
        else:
            k_len, v_len = int(need("attention.key_length")), int(need("attention.value_length"))
        sigmoid = int(f("expert_gating_func", 1)) == 2
        groups, used = int(f("expert_group_count", 1) or 1), int(f("expert_group_used_count", 1) or 1)
        q_rank = int(f("attention.q_lora_rank", 0) or 0)
        cfg |= {"model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
                "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
                "num_key_value_heads": heads, "intermediate_size": int(need("feed_forward_length")),
                "moe_intermediate_size": int(need("expert_feed_forward_length")), "n_routed_experts": E,
                "n_shared_experts": int(need("expert_shared_count")),
                "first_k_dense_replace": int(f("leading_dense_block_count", 0)),
                "kv_lora_rank": int(need("attention.kv_lora_rank")), "q_lora_rank": q_rank or None,
                "qk_rope_head_dim": rot, "qk_nope_head_dim": k_len - rot, "v_head_dim": v_len,
                "head_dim": rot, "routed_scaling_factor": float(f("expert_weights_scale", 1.0) or 1.0),
                "norm_topk_prob": bool(f("expert_weights_norm", False)), "n_group": groups, "topk_group": used,
                "num_nextn_predict_layers": 0}
        if sigmoid:
            cfg["rope_interleave"] = True
        else:
            cfg["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
        if rope is not None:
            log_mul = f("rope.scaling.yarn_log_multiplier")
            if log_mul is None:
                raise UserError(f"{path.name}: YaRN without {arch}.rope.scaling.yarn_log_multiplier is not one moec "
                                f"reads from a deepseek2 GGUF exactly")
            rope["mscale"] = rope["mscale_all_dim"] = float(log_mul) / 0.1  # the file stores 0.1 · mscale_all_dim
    else:  # gpt-oss
        n_layer = cfg["num_hidden_layers"]
        pattern = f("attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):
            sliding = [bool(x) for x in pattern]
        else:  # llama.cpp's set_swa_pattern: layer i slides unless it is the last of each group of `pattern`
            sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n_layer)]
        if f("rope.freq_base_swa") not in (None, theta):
            raise UserError(f"{path.name}: a separate RoPE base for sliding layers (gpt-oss.rope.freq_base_swa) is not "
                            f"one moec reads exactly")
        cfg |= {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                "num_key_value_heads": int(need("attention.head_count_kv")),
                "head_dim": int(need("attention.key_length")), "num_local_experts": E,
                "intermediate_size": int(need("expert_feed_forward_length")),
                "sliding_window": int(need("attention.sliding_window")), "attention_bias": True,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
        if rope is not None:
            rope["truncate"] = False  # the model's own YaRN (see the module docstring)
    cfg["rope_parameters"] = (rope or {"rope_type": "default"}) | {"rope_theta": theta}
    return cfg


def state_dict(path: Path, reader, arch: str, cfg: dict) -> dict:
    """HF tensors (fp32 torch) in transformers' on-disk layout, each GGUF tensor dequantized by gguf-py."""
    import torch

    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, str], np.ndarray] = {}  # tensors joined across GGUF names: k_b/v_b, gpt-oss experts
    for i, name, w in dequantized(reader):
        if i is None:  # a global tensor, under its HF name
            out[name] = torch.from_numpy(w.copy())
            continue
        p = f"model.layers.{i}."
        if name in LAYER[arch]:
            out[p + LAYER[arch][name]] = torch.from_numpy(w.copy())
        elif arch == "deepseek2" and name in _EXPERT_STACKS:  # [E, I, D] gate / up, [E, D, I] down
            h = name.split("_")[1]
            for e in range(w.shape[0]):
                out[f"{p}mlp.experts.{e}.{h}_proj.weight"] = torch.from_numpy(w[e].copy())
        else:
            parts[(i, name)] = w
    n_layer = cfg["num_hidden_layers"]
    for i in range(n_layer):
        p = f"model.layers.{i}."
        got = {name for (j, name) in parts if j == i}
        if arch == "deepseek2":
            if got:
                if got != {"attn_k_b.weight", "attn_v_b.weight"}:
                    raise UserError(f"{path.name}: blk.{i} holds {sorted(got)[0]} without its pair "
                                    f"(attn_k_b and attn_v_b come together)")
                kb, vb = parts[(i, "attn_k_b.weight")], parts[(i, "attn_v_b.weight")]  # [H, r, nope], [H, v, r]
                kv = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1)  # per head: nope rows, then v rows
                out[p + "self_attn.kv_b_proj.weight"] = torch.from_numpy(kv.reshape(-1, kv.shape[-1]).copy())
            if cfg["model_type"] == "deepseek_v3" and i >= cfg["first_k_dense_replace"]:
                out.setdefault(p + "mlp.gate.e_score_correction_bias", torch.zeros(cfg["n_routed_experts"]))
        elif got:
            need = set(SPECIAL["gpt-oss"])
            if got != need:
                raise UserError(f"{path.name}: blk.{i} lacks {sorted(need - got)[0]} (gpt-oss experts need "
                                f"gate, up and down, weights and biases)")
            g, u, d = (parts[(i, f"ffn_{h}_exps.weight")] for h in ("gate", "up", "down"))  # [E,I,D] x2, [E,D,I]
            gb, ub, db = (parts[(i, f"ffn_{h}_exps.bias")] for h in ("gate", "up", "down"))  # [E,I] x2, [E,D]
            E, inter, dim = g.shape
            gate_up = np.empty((E, dim, 2 * inter), np.float32)
            gate_up[..., 0::2], gate_up[..., 1::2] = g.transpose(0, 2, 1), u.transpose(0, 2, 1)
            bias = np.empty((E, 2 * inter), np.float32)
            bias[:, 0::2], bias[:, 1::2] = gb, ub
            out[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(gate_up)
            out[p + "mlp.experts.gate_up_proj_bias"] = torch.from_numpy(bias)
            out[p + "mlp.experts.down_proj"] = torch.from_numpy(np.ascontiguousarray(d.transpose(0, 2, 1)))
            out[p + "mlp.experts.down_proj_bias"] = torch.from_numpy(db.copy())
    if cfg["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


def check_with_transformers(path: Path, out: Path, model_type: str) -> None:
    """Load `out` with transformers on the meta device; UserError naming the first key it reports missing,
    unexpected or of another shape (each would be a silently changed model)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        _, info = transformers.AutoModelForCausalLM.from_pretrained(out, device_map="meta", output_loading_info=True)
    except Exception as e:  # a config transformers refuses: the metadata did not describe a model it builds
        raise UserError(f"{path.name}: read as {model_type}, transformers refuses it "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or ())
        if keys:
            raise UserError(f"{path.name}: read as {model_type}, transformers reports {kind.replace('_', ' ')} "
                            f"({len(keys)}, first {keys[0]}); refusing rather than loading a changed model")


def write_hf(path: Path, reader, arch: str, out: Path) -> dict:
    """Write `path` (a deepseek2 or gpt-oss GGUF) as an HF directory `out`; returns the config."""
    from safetensors.torch import save_file

    check_tensors(path, reader, arch)
    cfg = config(path, reader, arch)
    state = state_dict(path, reader, arch, cfg)
    cfg["moec_source"] = {"gguf": path.name, "read_by": "moec.calibrate.gguf_generic"}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    check_with_transformers(path, out, cfg["model_type"])
    return cfg
