"""A random-weight Mixtral-8x7B-, Qwen3-30B-A3B-, DeepSeek-V2-Lite-, GLM-4.5-Air- or gpt-oss-120b-shaped GGUF for
llama.cpp's llama-bench (the GPU peer).

    PYTHONPATH=GGUF_PY_DIR python3 benchmarks/peers/llamacpp_moe.py OUT.gguf [TYPE] [SHAPE]

GGUF_PY_DIR: llama.cpp's gguf-py (the writer of the same llama.cpp version as the llama-bench that reads it).

TYPE: Q2_K (default), Q4_0 or MXFP4 (gpt-oss's experts as shipped) for the expert and attention matrices (norms and
router F32, embeddings and output F16); SHAPE: mixtral (default), qwen3 or deepseek-v2-lite (llama.cpp's deepseek2
architecture with its MLA layout: attn_kv_a_mqa, attn_k_b / attn_v_b per head in F16 as its converter writes them,
one leading dense layer, two shared experts, YaRN; matrices whose rows are not whole Q2_K blocks of 256, the
1408-wide expert down projections and the dense 10944-wide one, take Q4_0 blocks of 32 as llama-quantize's fallback
takes a 4-bit 32-block type (IQ4_NL there, the same bytes per weight)), or glm-4.5-air (llama.cpp's glm4moe: q/k/v
biases, RoPE on 64 of 128 dims per head, one leading dense layer, one shared expert, sigmoid gating with
exp_probs_b, no MTP layer; the 1408-wide expert down projections and the dense 10944-wide one in Q4_0 as above), or
gpt-oss-120b (llama.cpp's gpt-oss: biases on q/k/v/o, the router and the experts, a sink per head, 128-token sliding
windows on the even layers, YaRN x32; attention F16, only the experts in TYPE, whose 2880 inputs are not whole Q2_K
blocks, so Q2_K falls back to Q4_0 there as llama-quantize does: label such a row Q4_0). Weights are random bytes
with finite block scales, so every kernel does its real work and the logits are meaningless. Vocabulary: placeholder
tokens (llama SPM model), enough for llama-bench, which feeds token ids directly. SMALL=1 in the environment writes
a tiny model (a quick check of the writer on a CPU); LAYERS=N the shape with its first N layers (a model whose file
would not fit the GPU machine's disk, timed against moec at the same layer count).
"""
import os
import sys

import gguf
import numpy as np

OUT = sys.argv[1]
QTYPE = sys.argv[2] if len(sys.argv) > 2 else "Q2_K"
SHAPE = sys.argv[3] if len(sys.argv) > 3 else "mixtral"

if SHAPE == "mixtral":
    D, F, L, E, K, H, HKV, V, HD, ARCH = 4096, 14336, 32, 8, 2, 32, 8, 32000, 128, "llama"
elif SHAPE == "deepseek-v2-lite":  # MLA: H heads of 128 + 64 (q/k) and 128 (v) over a 512 + 64 latent
    D, F, L, E, K, H, HKV, V, HD, ARCH = 2048, 1408, 27, 64, 6, 16, 1, 102400, 192, "deepseek2"
    R, ROPE, NOPE, VH, NSH, FD = 512, 64, 128, 128, 2, 10944
elif SHAPE == "glm-4.5-air":  # GQA 96/8 heads of 128, RoPE on the first 64 dims (NEOX halves)
    D, F, L, E, K, H, HKV, V, HD, ARCH = 4096, 1408, 46, 128, 8, 96, 8, 151552, 128, "glm4moe"
    ROPE, NSH, FD = 64, 1, 10944
elif SHAPE == "gpt-oss-120b":  # GQA 64/8 heads of 64 with sinks, 128-token windows on even layers, 128 experts top-4
    D, F, L, E, K, H, HKV, V, HD, ARCH = 2880, 2880, 36, 128, 4, 64, 8, 201088, 64, "gpt-oss"
else:  # Qwen3-30B-A3B
    D, F, L, E, K, H, HKV, V, HD, ARCH = 2048, 768, 48, 128, 8, 32, 4, 151936, 128, "qwen3moe"
if os.environ.get("SMALL"):
    D, F, L, V = 512, 1024, 2, 1000
    if ARCH == "deepseek2":
        F, E, FD = 352, 8, 704
    if ARCH == "glm4moe":
        F, E, H, HKV, FD = 352, 8, 8, 2, 704
    if ARCH == "gpt-oss":
        D, F, E, H, HKV = 512, 512, 8, 8, 2
if os.environ.get("LAYERS"):
    L = int(os.environ["LAYERS"])
rng = np.random.default_rng(0)
QT = getattr(gguf.GGMLQuantizationType, QTYPE)
BLK_ELEMS, BLK_BYTES = gguf.GGML_QUANT_SIZES[QT]


def quant(rows_shape, n_in, qtype=QTYPE):
    """Random blocks of `qtype` (TYPE unless said) for a matrix [*rows_shape, n_in], with sane fp16 scales."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    a = rng.integers(0, 256, size=(*rows_shape, n_in // elems * nbytes), dtype=np.uint8)
    b = a.reshape(-1, nbytes)
    if qtype == "Q2_K":  # scales[16] qs[64] d dmin
        b[:, 80:82] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        b[:, 82:84] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    elif qtype == "Q4_0":  # d qs[16]
        b[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    elif qtype == "MXFP4":  # e (e8m0) qs[16]: weights up to 6 · 2^-7
        b[:, 0] = 127 - 7
    return a


def qtensor(w, name, rows_shape, n_in):
    """A quantized matrix: TYPE where its rows are whole blocks of it, else Q4_0 (llama-quantize's fallback)."""
    qtype = QTYPE if n_in % BLK_ELEMS == 0 else "Q4_0"
    w.add_tensor(name, quant(rows_shape, n_in, qtype), raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))


def lead_dense_or_shared_moe(p: str, i: int, probs_bias: bool) -> None:
    """The FFN of layer i of deepseek2 / glm4moe: the leading dense layer (i = 0), else the router (with glm4moe's
    exp_probs_b selection bias), E routed experts and NSH shared ones."""
    if i == 0:
        qtensor(w, p + "ffn_gate.weight", (FD,), D)
        qtensor(w, p + "ffn_up.weight", (FD,), D)
        qtensor(w, p + "ffn_down.weight", (D,), FD)
        return
    w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, D), dtype=np.float32) * 0.02)
    if probs_bias:
        w.add_tensor(p + "exp_probs_b.bias", np.zeros(E, np.float32))
    for n, rows, n_in in (("gate_exps", (E, F), D), ("up_exps", (E, F), D), ("down_exps", (E, D), F),
                          ("gate_shexp", (F * NSH,), D), ("up_shexp", (F * NSH,), D), ("down_shexp", (D,), F * NSH)):
        qtensor(w, f"{p}ffn_{n}.weight", rows, n_in)
    if i % 8 == 0:
        print("layer", i, flush=True)


def f16(*s):
    return (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16)


w = gguf.GGUFWriter(OUT, ARCH)
w.add_name(f"{SHAPE}-shape-random")
w.add_context_length(131072)
w.add_embedding_length(D)
w.add_block_count(L)
w.add_feed_forward_length(FD if ARCH in ("deepseek2", "glm4moe") else F)
w.add_head_count(H)
w.add_head_count_kv(HKV)
w.add_rope_dimension_count(ROPE if ARCH in ("deepseek2", "glm4moe") else HD)
w.add_rope_freq_base({"deepseek2": 1e4, "gpt-oss": 1.5e5}.get(ARCH, 1e6))
w.add_layer_norm_rms_eps(1e-6)
if ARCH == "deepseek2":  # llama.cpp's MLA file: the cache is the latent, one "head" of kv_lora + rope
    w.add_key_length(R + ROPE)
    w.add_value_length(R)
    w.add_uint32(f"{ARCH}.attention.key_length_mla", NOPE + ROPE)
    w.add_uint32(f"{ARCH}.attention.value_length_mla", VH)
    w.add_uint32(f"{ARCH}.attention.kv_lora_rank", R)
    w.add_uint32(f"{ARCH}.expert_feed_forward_length", F)
    w.add_uint32(f"{ARCH}.expert_shared_count", NSH)
    w.add_uint32(f"{ARCH}.leading_dense_block_count", 1)
    w.add_float32(f"{ARCH}.expert_weights_scale", 1.0)
    w.add_bool(f"{ARCH}.expert_weights_norm", False)
    w.add_uint32(f"{ARCH}.expert_gating_func", 1)  # softmax
    w.add_string(f"{ARCH}.rope.scaling.type", "yarn")
    w.add_float32(f"{ARCH}.rope.scaling.factor", 40.0)
    w.add_uint32(f"{ARCH}.rope.scaling.original_context_length", 4096)
    w.add_float32(f"{ARCH}.rope.scaling.yarn_log_multiplier", 0.1 * 0.707)
else:
    w.add_key_length(HD)
    w.add_value_length(HD)
if ARCH == "glm4moe":
    w.add_uint32(f"{ARCH}.expert_feed_forward_length", F)
    w.add_uint32(f"{ARCH}.expert_shared_count", NSH)
    w.add_uint32(f"{ARCH}.leading_dense_block_count", 1)
    w.add_float32(f"{ARCH}.expert_weights_scale", 1.0)
    w.add_bool(f"{ARCH}.expert_weights_norm", True)
    w.add_uint32(f"{ARCH}.expert_gating_func", 2)  # sigmoid
    w.add_uint32(f"{ARCH}.nextn_predict_layers", 0)  # the MTP layer is left out (decode does not use it)
if ARCH in ("qwen3moe", "gpt-oss"):
    w.add_expert_feed_forward_length(F)
if ARCH == "gpt-oss":  # sliding windows on the even layers (llama.cpp's default pattern for it), YaRN x32
    w.add_sliding_window(128)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
w.add_expert_count(E)
w.add_expert_used_count(K)
w.add_vocab_size(V)
w.add_file_type(1)
w.add_tokenizer_model("llama")
w.add_token_list([f"<t{i}>".encode() for i in range(V)])
w.add_token_scores([0.0] * V)
w.add_token_types([1] * V)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_tensor("token_embd.weight", f16(V, D))
for i in range(L if ARCH == "deepseek2" else 0):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
    w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
    w.add_tensor(p + "attn_kv_a_norm.weight", np.ones(R, np.float32))
    qtensor(w, p + "attn_q.weight", (H * (NOPE + ROPE),), D)
    qtensor(w, p + "attn_kv_a_mqa.weight", (R + ROPE,), D)
    w.add_tensor(p + "attn_k_b.weight", f16(H, R, NOPE))  # [H, r, nope]: kv_b's key rows, transposed per head
    w.add_tensor(p + "attn_v_b.weight", f16(H, VH, R))
    qtensor(w, p + "attn_output.weight", (D,), H * VH)
    lead_dense_or_shared_moe(p, i, probs_bias=False)
for i in range(L if ARCH == "glm4moe" else 0):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
    w.add_tensor(p + "post_attention_norm.weight", np.ones(D, np.float32))  # the FFN's input norm in glm4moe
    for n, rows in (("attn_q", HD * H), ("attn_k", HD * HKV), ("attn_v", HD * HKV)):
        qtensor(w, p + n + ".weight", (rows,), D)
        w.add_tensor(p + n + ".bias", rng.standard_normal(rows, dtype=np.float32) * 0.02)
    qtensor(w, p + "attn_output.weight", (D,), HD * H)
    lead_dense_or_shared_moe(p, i, probs_bias=True)
for i in range(L if ARCH == "gpt-oss" else 0):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
    w.add_tensor(p + "post_attention_norm.weight", np.ones(D, np.float32))  # the FFN's input norm
    for n, rows, n_in in (("attn_q", HD * H, D), ("attn_k", HD * HKV, D), ("attn_v", HD * HKV, D),
                          ("attn_output", D, HD * H)):  # F16, as the experts-* recipes keep attention
        w.add_tensor(p + n + ".weight", f16(rows, n_in))
        w.add_tensor(p + n + ".bias", rng.standard_normal(rows, dtype=np.float32) * 0.02)
    w.add_tensor(p + "attn_sinks.weight", np.zeros(H, np.float32))
    w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, D), dtype=np.float32) * 0.02)
    w.add_tensor(p + "ffn_gate_inp.bias", np.zeros(E, np.float32))
    for n, rows, n_in in (("gate_exps", (E, F), D), ("up_exps", (E, F), D), ("down_exps", (E, D), F)):
        qtensor(w, f"{p}ffn_{n}.weight", rows, n_in)
        w.add_tensor(f"{p}ffn_{n}.bias", np.zeros(rows, np.float32))
    if i % 8 == 0:
        print("layer", i, flush=True)
for i in range(0 if ARCH in ("deepseek2", "glm4moe", "gpt-oss") else L):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
    w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
    for n, rows, cols in (("attn_q", HD * H, D), ("attn_k", HD * HKV, D), ("attn_v", HD * HKV, D),
                          ("attn_output", D, HD * H)):
        w.add_tensor(p + n + ".weight", quant((rows,), cols), raw_dtype=QT)
    if ARCH == "qwen3moe":
        w.add_tensor(p + "attn_q_norm.weight", np.ones(HD, np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(HD, np.float32))
    w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, D), dtype=np.float32) * 0.02)
    w.add_tensor(p + "ffn_gate_exps.weight", quant((E, F), D), raw_dtype=QT)
    w.add_tensor(p + "ffn_up_exps.weight", quant((E, F), D), raw_dtype=QT)
    w.add_tensor(p + "ffn_down_exps.weight", quant((E, D), F), raw_dtype=QT)
    if i % 8 == 0:
        print("layer", i, flush=True)
w.add_tensor("output_norm.weight", np.ones(D, np.float32))
w.add_tensor("output.weight", f16(V, D))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file(progress=False)
w.close()
print("wrote", OUT)
