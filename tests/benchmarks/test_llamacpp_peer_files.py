"""The llama.cpp peer's random GGUF writer (benchmarks/peers/llamacpp_moe.py) at its DeepSeek-V2-Lite shape, small
(SMALL=1): moec's deepseek2 GGUF reader (checked against llama.cpp itself, benchmarks/studies/gguf_read_llamacpp.py)
maps every tensor and key it writes, and transformers loads the result without a missing or unexpected weight
(gguf_generic.write_hf checks both), so llama-bench meets the layout it expects on the GPU machine."""

import os
import subprocess
import sys
from pathlib import Path

import gguf

from moec.calibrate import gguf_generic
from moec.runtime.hf_layout import HFCheckpoint

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "llamacpp_moe.py"


def test_deepseek_v2_lite_peer_file_reads_as_mla(tmp_path):
    f = tmp_path / "ds2.gguf"
    r = subprocess.run([sys.executable, str(SCRIPT), str(f), "Q2_K", "deepseek-v2-lite"], capture_output=True,
                       text=True, env=os.environ | {"SMALL": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    gguf_generic.write_hf(f, gguf.GGUFReader(str(f)), "deepseek2", tmp_path / "hf")
    a = HFCheckpoint(tmp_path / "hf").args
    assert (a.arch, a.attn_kind, a.kv_lora_rank, a.qk_rope_dim, a.v_head_dim) == ("deepseek_v2", "mla", 512, 64, 128)
    assert a.ffn_kinds == ["dense", "moe"] and a.shared_dim == 2 * a.expert_dim and a.top_k == 6
    assert a.rope_scaling["rope_type"] == "yarn" and a.rope_scaling["factor"] == 40.0


def test_glm_peer_file_has_the_glm4moe_layout(tmp_path):
    """The writer at its GLM-4.5-Air shape, small: exactly the tensors llama.cpp's glm4moe loader creates without
    MTP (src/models/glm4-moe.cpp of the llama-cpp-python 0.3.36 sources: biased q/k/v, post_attention_norm, one
    leading dense layer, exp_probs_b, one shared expert), in its dimension order, and the hyperparameters it
    reads (partial RoPE, sigmoid gating)."""
    f = tmp_path / "glm.gguf"
    r = subprocess.run([sys.executable, str(SCRIPT), str(f), "Q2_K", "glm-4.5-air"], capture_output=True,
                       text=True, env=os.environ | {"SMALL": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    g = gguf.GGUFReader(str(f))
    D, H, HKV, HD, E, F, FD = 512, 8, 2, 128, 8, 352, 704
    want = {"token_embd.weight": [D, 1000], "output_norm.weight": [D], "output.weight": [D, 1000]}
    for i in range(2):
        p = f"blk.{i}."
        want |= {p + "attn_norm.weight": [D], p + "post_attention_norm.weight": [D],
                 p + "attn_q.weight": [D, H * HD], p + "attn_k.weight": [D, HKV * HD],
                 p + "attn_v.weight": [D, HKV * HD],
                 p + "attn_q.bias": [H * HD], p + "attn_k.bias": [HKV * HD], p + "attn_v.bias": [HKV * HD],
                 p + "attn_output.weight": [H * HD, D]}
        if i == 0:
            want |= {p + "ffn_gate.weight": [D, FD], p + "ffn_up.weight": [D, FD], p + "ffn_down.weight": [FD, D]}
        else:
            want |= {p + "ffn_gate_inp.weight": [D, E], p + "exp_probs_b.bias": [E],
                     p + "ffn_gate_exps.weight": [D, F, E], p + "ffn_up_exps.weight": [D, F, E],
                     p + "ffn_down_exps.weight": [F, D, E], p + "ffn_gate_shexp.weight": [D, F],
                     p + "ffn_up_shexp.weight": [D, F], p + "ffn_down_shexp.weight": [F, D]}
    got = {t.name: [int(n) for n in t.shape] for t in g.tensors}
    assert got == want
    kv = {k: v.parts[v.data[0]].tolist() for k, v in g.fields.items() if k.startswith("glm4moe.")}
    assert kv["glm4moe.rope.dimension_count"] == [64] and kv["glm4moe.attention.key_length"] == [HD]
    assert kv["glm4moe.expert_gating_func"] == [2] and kv["glm4moe.leading_dense_block_count"] == [1]
    assert kv["glm4moe.expert_shared_count"] == [1] and kv["glm4moe.nextn_predict_layers"] == [0]


def test_gpt_oss_peer_file_has_the_gpt_oss_layout(tmp_path):
    """The writer at its gpt-oss-120b shape, small, with MXFP4 experts: exactly the tensors llama.cpp's gpt-oss
    loader creates (src/models/openai-moe.cpp of the same sources: q/k/v/o with biases, a sink per head,
    post_attention_norm, the biased router and biased experts), in its dimension order, the experts MXFP4 and the
    rest as the experts-* recipes keep it, and the hyperparameters it reads (the sliding window, YaRN). The same
    small file loads and decodes past its window in a CPU build of those sources (llama-bench tg4 @ d300)."""
    f = tmp_path / "oss.gguf"
    r = subprocess.run([sys.executable, str(SCRIPT), str(f), "MXFP4", "gpt-oss-120b"], capture_output=True,
                       text=True, env=os.environ | {"SMALL": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    g = gguf.GGUFReader(str(f))
    D, H, HKV, HD, E, F = 512, 8, 2, 64, 8, 512
    want = {"token_embd.weight": [D, 1000], "output_norm.weight": [D], "output.weight": [D, 1000]}
    for i in range(2):
        p = f"blk.{i}."
        want |= {p + "attn_norm.weight": [D], p + "post_attention_norm.weight": [D],
                 p + "attn_q.weight": [D, H * HD], p + "attn_k.weight": [D, HKV * HD],
                 p + "attn_v.weight": [D, HKV * HD], p + "attn_output.weight": [H * HD, D],
                 p + "attn_q.bias": [H * HD], p + "attn_k.bias": [HKV * HD], p + "attn_v.bias": [HKV * HD],
                 p + "attn_output.bias": [D], p + "attn_sinks.weight": [H],
                 p + "ffn_gate_inp.weight": [D, E], p + "ffn_gate_inp.bias": [E],
                 p + "ffn_gate_exps.weight": [D, F, E], p + "ffn_up_exps.weight": [D, F, E],
                 p + "ffn_down_exps.weight": [F, D, E], p + "ffn_gate_exps.bias": [F, E],
                 p + "ffn_up_exps.bias": [F, E], p + "ffn_down_exps.bias": [D, E]}
    got = {t.name: [int(n) for n in t.shape] for t in g.tensors}
    assert got == want
    types = {t.name: t.tensor_type for t in g.tensors}
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    kv = {k: v.parts[v.data[0]].tolist() for k, v in g.fields.items() if k.startswith("gpt-oss.")}
    assert kv["gpt-oss.attention.sliding_window"] == [128] and kv["gpt-oss.expert_feed_forward_length"] == [F]
    assert kv["gpt-oss.rope.scaling.factor"] == [32.0] and kv["gpt-oss.attention.key_length"] == [HD]
