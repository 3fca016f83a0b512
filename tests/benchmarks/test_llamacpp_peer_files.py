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
