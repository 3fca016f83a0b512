"""GGUF export (llama.cpp), written with gguf-py's GGUFWriter under the `llama` architecture, which
llama.cpp runs for Llama and for Mixtral (experts stacked as `blk.N.ffn_{gate,up,down}_exps`).

Quantized mappings: intsym 4-/8-bit in groups of 32 -> Q4_0 / Q8_0 (below: intsym_tensor), and rtn 4-bit in
groups of 32 (formats/codecs.py: codes + fp16 scale, zero [E, O, G];
w = zero + scale·idx) -> GGML Q4_1, whose 20-byte block of 32 weights is fp16 d, fp16 m, then 16 bytes of
which byte j holds q[j] in its low nibble and q[j + 16] in its high one; w = d·q + m. With d = scale,
m = zero, q = idx both sides compute fl32(m + d·q) from the same fp16 values (d·q, an 11-bit mantissa
times a 4-bit integer, is exact in fp32), so gguf.quants.dequantize and moec's dequant_ref agree bit for
bit (tests/export/test_export_gguf.py). llama.cpp's own matmuls then quantize activations (Q8_1): its
logits differ from moec's by that, not by the weights (benchmarks/export_llamacpp_check.py).

mxfp4 -> GGML MXFP4, whose 17-byte block of 32 weights is the e8m0 byte e, then 16 bytes of which byte j holds
code j in its low nibble and code j + 16 in its high one (moec's codes put inputs 2j, 2j + 1 in one byte:
repacked); llama.cpp computes kvalue · 2^(e − 128) with kvalues the doubled e2m1 values, moec e2m1 · 2^(e − 127):
the same fp32 products, exactly (tests/export/test_export_fp4.py).

Kept tensors keep their values: 1-D ones and the router as F32 (as llama.cpp's converter writes them),
matrices in their stored dtype (F16, BF16 or F32). Attention q/k rows are permuted from the HF
rotate-half layout to GGML's interleaved RoPE pairs, as llama.cpp's converter does; a row permutation moves
whole Q4_1 rows, so it stays exact. The tokenizer (a BPE tokenizer.json beside the checkpoint) goes in as
llama.cpp's `gpt2` model with the pre-tokenizer that splits text as the model's tokenizer does (`tokenizer_pre`:
a source GGUF's own value, or ByteLevel with the GPT-2 pattern -> `gpt-2`; anything else is refused, since
llama.cpp would tokenize differently) and bos/eos/pad as the model's config.json says; without a tokenizer.json
the file holds no vocabulary and llama.cpp can load it only with a vocabulary from elsewhere (a warning says so).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from ..atomic import atomic_dir
from ..errors import UserError
from ..formats import bitpack
from .source import PackedModel, Param, export_tensors, refuse_unless_carried

log = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
EXPORT_INFO = "moec-export.json"
_GLOBAL = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "output.weight": "output.weight"}
_LAYER = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
          "attn.wq.weight": "attn_q.weight", "attn.wk.weight": "attn_k.weight", "attn.wv.weight": "attn_v.weight",
          "attn.wo.weight": "attn_output.weight", "moe.router.weight": "ffn_gate_inp.weight",
          "moe.w1": "ffn_gate", "moe.w3": "ffn_up", "moe.w2": "ffn_down"}


def is_export(path: Path) -> bool:
    return (path / EXPORT_INFO).is_file()


def gguf_name(name: str, dense: bool) -> str:
    """GGUF tensor name of a canonical parameter (experts get `_exps`, a dense MLP the plain name)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, layer, rest = name.split(".", 2)
    base = _LAYER[rest]
    if rest.startswith("moe.w"):
        base += ".weight" if dense else "_exps.weight"
    return f"blk.{layer}.{base}"


def rtn_reason(p: Param) -> str | None:
    """The rtn codec's GGUF hook (moec/codecs/hls.py): Q4_1 holds 4-bit codes in groups of 32 with fp16 d, m."""
    if p.bits == 4 and p.group == 32 and p.parts["scale"].dtype == p.parts["zero"].dtype == torch.float16:
        return None
    return f"Q4_1 holds rtn 4-bit in groups of 32 with fp16 scale and zero; this is {p.bits}-bit in groups of {p.group}"


def fp8_reason(p: Param) -> str:
    """The fp8 codec's GGUF hook: none of GGML's types is e4m3."""
    return "GGUF has no e4m3 type"


def rtn_tensor(p: Param):
    """The rtn codec's GGUF tensor: (Q4_1 blocks [E, O, G·20] uint8, the GGML type)."""
    import gguf

    return q4_1_blocks(p), gguf.GGMLQuantizationType.Q4_1


def q4_1_blocks(p: Param) -> torch.Tensor:
    """uint8 [E, O, G·20]: the Q4_1 blocks of an rtn 4-bit g32 parameter (layout in the module docstring)."""
    E, O, I = p.parts["codes"].shape[0], p.parts["scale"].shape[1], p.shape[-1]
    G = I // 32
    idx = bitpack.unpack(p.parts["codes"], 4, I).view(E, O, G, 32).to(torch.uint8)
    qs = idx[..., :16] | (idx[..., 16:] << 4)
    d = p.parts["scale"].contiguous().view(torch.uint8).view(E, O, G, 2)
    m = p.parts["zero"].contiguous().view(torch.uint8).view(E, O, G, 2)
    return torch.cat([d, m, qs], -1).reshape(E, O, G * 20)


# -- intsym (moec/codecs/intsym.py) -> Q4_0 / Q8_0 ---------------------------------------------------------------
# Q4_0: an 18-byte block of 32 weights: fp16 d, then 16 bytes of which byte j holds u[j] in its low nibble and
# u[j + 16] in its high one (u in 0..15); w = d·(u - 8). Q8_0: a 34-byte block: fp16 d, 32 int8 q; w = d·q.
# intsym stores code = q + 2^(b-1) and an fp16 scale per group: with groups of 32, d = scale and u = code
# (4-bit) or q = code - 128 (8-bit), and both sides compute fl32(d·q), exact (an 11-bit mantissa times an
# integer of at most 8 bits), so gguf.quants.dequantize gives moec's weights bit for bit.

def intsym_reason(p: Param) -> str | None:
    """The intsym codec's GGUF hook: Q4_0 / Q8_0 hold 4- / 8-bit symmetric levels in groups of 32."""
    if p.bits in (4, 8) and p.shape[-1] // p.parts["scale"].shape[-1] == 32:
        return None
    return (f"Q4_0 / Q8_0 hold symmetric 4- / 8-bit levels in groups of 32; this is {p.bits}-bit in groups of "
            f"{p.shape[-1] // p.parts['scale'].shape[-1]}")


def intsym_tensor(p: Param):
    """The intsym codec's GGUF tensor: (Q4_0 [E, O, G·18] or Q8_0 [E, O, G·34] blocks as uint8, the GGML type)."""
    import gguf

    E, O, G = p.parts["scale"].shape
    I = p.shape[-1]
    code = bitpack.unpack(p.parts["codes"], p.bits, I).view(E, O, G, 32)
    d = p.parts["scale"].contiguous().view(torch.uint8).view(E, O, G, 2)
    if p.bits == 4:
        u = code.to(torch.uint8)
        return torch.cat([d, u[..., :16] | (u[..., 16:] << 4)], -1).reshape(E, O, G * 18), \
            gguf.GGMLQuantizationType.Q4_0
    q = (code - 128).to(torch.int8).view(torch.uint8)
    return torch.cat([d, q], -1).reshape(E, O, G * 34), gguf.GGMLQuantizationType.Q8_0


def mxfp4_reason(p: Param) -> None:
    """The mxfp4 codec's GGUF hook: GGML's MXFP4 block is moec's mxfp4 block (e8m0 scale per 32 e2m1 codes)."""
    return None


def mxfp4_tensor(p: Param):
    """The mxfp4 codec's GGUF tensor: (MXFP4 blocks [E, O, G·17] uint8, the GGML type)."""
    import gguf

    E, O, I = p.parts["codes"].shape[0], p.parts["codes"].shape[1], p.shape[-1]
    G = I // 32
    c = bitpack.unpack(p.parts["codes"], 4, I).view(E, O, G, 32).to(torch.uint8)
    qs = c[..., :16] | (c[..., 16:] << 4)
    return torch.cat([p.parts["scale"].contiguous().view(E, O, G, 1), qs], -1).reshape(E, O, G * 17), \
        gguf.GGMLQuantizationType.MXFP4


# the file type a GGUF declares (general.file_type, informational) by the GGML type of its quantized tensors
_FILE_TYPE = {"MXFP4": "MOSTLY_MXFP4_MOE"}  # general.file_type where it is not MOSTLY_<type>


def permute_rope_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows [n_head·hd, ...] from HF's rotate-half order to GGML's interleaved pairs (per head: rows
    0, hd/2, 1, hd/2 + 1, ...), what llama.cpp's converter does to q and k."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _check_arch(model: PackedModel) -> None:
    a = model.args
    if a.arch not in ("llama", "mixtral"):
        raise UserError(f"GGUF export maps the llama and mixtral architectures; this checkpoint is {a.arch} "
                        f"(--format ct carries it)")
    if a.rope_scaling or a.qkv_bias or a.o_bias or a.qk_norm != "none" or a.shared_dim:
        raise UserError("GGUF export maps plain Llama/Mixtral layers; this checkpoint has RoPE scaling, biases, "
                        "q/k norms or shared experts (--format ct carries it)")


def _np(t: torch.Tensor) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for GGUFWriter.add_tensor; bf16 goes as its raw 16-bit words."""
    from gguf import GGMLQuantizationType

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy(), GGMLQuantizationType.BF16
    if t.dtype in (torch.float16, torch.float32):
        return t.contiguous().numpy(), None
    raise UserError(f"kept tensor of dtype {t.dtype} has no GGUF type here")


def write_gguf(model: PackedModel, out: Path) -> dict:
    import gguf

    _check_arch(model)
    refuse_unless_carried(model, "gguf")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # gguf-py logs every step of the write at INFO
    a = model.args
    dense = not a.is_moe
    tensors: dict[str, tuple[np.ndarray, object]] = {}
    quantized: dict[str, int] = {}  # GGML type name -> tensors of it
    for p in model.params.values():
        if p.kept:  # 1-D tensors and the router in F32, as llama.cpp's converter writes them
            t = p.tensor.float() if p.tensor.dim() == 1 or p.name.endswith("router.weight") else p.tensor
        else:  # the codec's registered GGUF mapping (rtn 4-bit g32: Q4_1 blocks [E, O, G·20])
            t, qtype = export_tensors(p, "gguf")
            quantized[qtype.name] = quantized.get(qtype.name, 0) + 1
        if t.dim() == 3 and (len(p.shape) == 2 or (dense and ".moe.w" in p.name)):
            t = t[0]  # attention projections and dense MLPs are plain matrices in GGUF
        if p.name.endswith(("attn.wq.weight", "attn.wk.weight")):
            t = permute_rope_rows(t, a.n_heads if p.name.endswith("wq.weight") else a.n_kv_heads)
        tensors[gguf_name(p.name, dense)] = _np(t) if p.kept else (t.contiguous().numpy(), qtype)

    size = sum(arr.nbytes for arr, _ in tensors.values())
    with atomic_dir(out, is_output=is_export, what="a moec export", size_hint=size) as tmp:
        w = gguf.GGUFWriter(str(tmp / GGUF_FILE), "llama")
        w.add_name(str(model.manifest["source"].get("model", "moec export")))
        w.add_file_type(_file_type(quantized))
        w.add_vocab_size(a.vocab_size)
        w.add_context_length(a.max_seq_len)
        w.add_embedding_length(a.dim)
        w.add_block_count(a.n_layers)
        w.add_feed_forward_length(a.dense_dim if dense else a.expert_dim)
        w.add_head_count(a.n_heads)
        w.add_head_count_kv(a.n_kv_heads)
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
        w.add_rope_dimension_count(a.head_dim)
        w.add_rope_freq_base(a.rope_theta)
        w.add_layer_norm_rms_eps(a.norm_eps)
        if not dense:
            w.add_expert_count(a.n_experts)
            w.add_expert_used_count(a.top_k)
        vocab = _add_tokenizer(w, model.path, a.vocab_size, model.config)
        for name, (arr, raw) in tensors.items():
            w.add_tensor(name, arr, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        info = {"format": "gguf", "file": GGUF_FILE, "source": str(model.path), "arch": "llama",
                "q4_1_tensors": quantized.get("Q4_1", 0), "quantized_tensors": quantized, "tensors": len(tensors),
                "tokenizer": vocab}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    return info


def _file_type(quantized: dict[str, int]):
    """general.file_type: the GGML type most tensors have (F16 when none is quantized)."""
    import gguf

    if not quantized:
        return gguf.LlamaFileType.MOSTLY_F16
    main = max(quantized, key=quantized.get)
    return gguf.LlamaFileType[_FILE_TYPE.get(main, f"MOSTLY_{main}")]


# the GPT-2 split pattern (tokenizers' ByteLevel with use_regex, or an explicit Split before a regex-less ByteLevel):
# llama.cpp's `gpt-2` pre-tokenizer applies the same pattern
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def tokenizer_pre(tok: dict, config: dict, where: Path) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json: the source GGUF's own value when the model came
    from one (calibrate/sources.gguf_to_hf records it), else the mapping of its pre_tokenizer (ByteLevel with
    the GPT-2 pattern: `gpt-2`); UserError for a pre-tokenizer no llama.cpp name is known to reproduce."""
    pre = (config.get("moec_source") or {}).get("tokenizer_pre")
    if pre:
        return pre
    p = tok.get("pre_tokenizer") or {}
    steps = p.get("pretokenizers", []) if p.get("type") == "Sequence" else [p]
    kinds = [s.get("type") for s in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" and not steps[-1].get("add_prefix_space") else None
    if byte_level is not None and len(steps) == 1 and byte_level.get("use_regex", True):
        return "gpt-2"
    if byte_level is not None and kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True) \
            and (steps[0].get("pattern") or {}).get("Regex") == GPT2_PATTERN \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        return "gpt-2"
    what = "+".join(f"{k}" for k in kinds) or "none"
    raise UserError(f"{where / 'tokenizer.json'}: pre-tokenizer {what} has no llama.cpp pre-tokenizer known to "
                    f"split text the same way (moec maps ByteLevel with the GPT-2 pattern to gpt-2, and keeps a "
                    f"source GGUF's own); llama.cpp would tokenize differently from the model")


def special_ids(config: dict) -> dict[str, int]:
    """{bos, eos, pad: id} from the model's config.json (its generation's stop token is the config's eos; a
    list of eos ids gives its first)."""
    out = {}
    for kind in ("bos", "eos", "pad"):
        v = config.get(f"{kind}_token_id")
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            out[kind] = v
    return out


def _add_tokenizer(w, path: Path, vocab_size: int, config: dict) -> bool:
    """The BPE vocabulary of `path/tokenizer.json` as llama.cpp's `gpt2` tokenizer (the pre-tokenizer from
    tokenizer_pre, bos/eos/pad as the model's config.json says); False when there is none."""
    import gguf

    f = path / "tokenizer.json"
    tok = json.loads(f.read_text()) if f.is_file() else {}
    if (tok.get("model") or {}).get("type") != "BPE":
        log.warning("%s: no BPE tokenizer.json, so the GGUF holds no vocabulary (llama.cpp needs one to load it)",
                    path)
        return False
    pre = tokenizer_pre(tok, config, path)
    ids = {i: t for t, i in tok["model"]["vocab"].items()}
    special = set()
    for t in tok.get("added_tokens", []):
        ids[t["id"]] = t["content"]
        if t.get("special"):
            special.add(t["id"])
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(ids.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.CONTROL if i in special else
                     gguf.TokenType.NORMAL if i in ids else gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    sv = gguf.SpecialVocab(path, load_merges=True, n_vocab=vocab_size)
    sv.special_token_ids.update({k: v for k, v in special_ids(config).items() if v < vocab_size})
    sv.add_to_gguf(w)
    return True
