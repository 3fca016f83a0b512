"""A random-weight Mixtral-8x7B- or Qwen3-30B-A3B-shaped GGUF for llama.cpp's llama-bench (the GPU peer).

    PYTHONPATH=GGUF_PY_DIR python3 benchmarks/peers/llamacpp_moe.py OUT.gguf [TYPE] [SHAPE]

GGUF_PY_DIR: llama.cpp's gguf-py (the writer of the same llama.cpp version as the llama-bench that reads it).

TYPE: Q2_K (default) or Q4_0 for the expert and attention matrices (norms and router F32, embeddings and
output F16); SHAPE: mixtral (default) or qwen3. Weights are random bytes with finite block scales, so every
kernel does its real work and the logits are meaningless. Vocabulary: placeholder tokens (llama SPM model),
enough for llama-bench, which feeds token ids directly. SMALL=1 in the environment writes a tiny model (a quick
check of the writer on a CPU).
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
else:  # Qwen3-30B-A3B
    D, F, L, E, K, H, HKV, V, HD, ARCH = 2048, 768, 48, 128, 8, 32, 4, 151936, 128, "qwen3moe"
if os.environ.get("SMALL"):
    D, F, L, V = 512, 1024, 2, 1000
rng = np.random.default_rng(0)
QT = getattr(gguf.GGMLQuantizationType, QTYPE)
BLK_ELEMS, BLK_BYTES = gguf.GGML_QUANT_SIZES[QT]


def quant(rows_shape, n_in):
    """Random blocks of QT for a matrix [*rows_shape, n_in], with sane fp16 scales."""
    a = rng.integers(0, 256, size=(*rows_shape, n_in // BLK_ELEMS * BLK_BYTES), dtype=np.uint8)
    b = a.reshape(-1, BLK_BYTES)
    if QTYPE == "Q2_K":  # scales[16] qs[64] d dmin
        b[:, 80:82] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        b[:, 82:84] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    elif QTYPE == "Q4_0":  # d qs[16]
        b[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return a


def f16(*s):
    return (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16)


w = gguf.GGUFWriter(OUT, ARCH)
w.add_name(f"{SHAPE}-shape-random")
w.add_context_length(131072)
w.add_embedding_length(D)
w.add_block_count(L)
w.add_feed_forward_length(F)
w.add_head_count(H)
w.add_head_count_kv(HKV)
w.add_rope_dimension_count(HD)
w.add_rope_freq_base(1e6)
w.add_layer_norm_rms_eps(1e-6)
w.add_key_length(HD)
w.add_value_length(HD)
if ARCH == "qwen3moe":
    w.add_expert_feed_forward_length(F)
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
for i in range(L):
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
