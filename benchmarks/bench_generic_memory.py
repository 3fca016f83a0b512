"""Peak memory of `moec calibrate` on the transformers path (moec/calibrate/generic_capture.py): a random-weight
Mixtral-layout model (per-expert w1/w2/w3 in the checkpoint, fused by transformers' conversions at load) saved
as one safetensors shard per decoder layer, calibrated with an expert recipe in a fresh process: fp8 experts,
whose fit is a scale and a cast, so the peak is the path's (weights streamed, every expert's Hessians captured
and damped) and not a LUT quantizer's per-expert distance tables.

    python3 -m benchmarks.bench_generic_memory                      # 8 layers of 0.5 GB (bf16) each
    python3 -m benchmarks.bench_generic_memory --hidden 1024 --experts 16 --out results/generic_memory_cpu_small.json

Measured: peak RSS (VmHWM) minus RSS after the imports (and the calibration text's tokenization), against
    bound = 1.5 × (one layer's weights as held (fp32, the compute dtype) + its Hessians + activations)
with Hessians = E·(D² + I²)·4 bytes (gate_up's and down's inputs per expert) and activations = the calibration
hidden states (samples × seq_len × D fp32, two copies: a layer's input and output) plus one batch's attention
scores. The global tensors (embeddings, LM head) are held throughout: counted in the weights term as well.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(path: Path, hidden: int, inter: int, experts: int, layers: int, vocab: int = 8192) -> dict:
    """The model directory, written shard by shard (one decoder layer in memory at a time)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    heads, kv = max(1, hidden // 128), max(1, hidden // 512)
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hidden // heads, "num_local_experts": experts,
           "num_experts_per_tok": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "dtype": "bfloat16",
           "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    weight_map = {}
    files = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]
    glob = {"model.embed_tokens.weight": rnd(vocab, hidden), "lm_head.weight": rnd(vocab, hidden),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    save_file(glob, str(path / files[0]))
    weight_map.update(dict.fromkeys(glob, files[0]))
    hd = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
             p + "self_attn.k_proj.weight": rnd(kv * hd, hidden),
             p + "self_attn.v_proj.weight": rnd(kv * hd, hidden),
             p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
             p + "block_sparse_moe.gate.weight": rnd(experts, hidden)}
        for e in range(experts):
            m = f"{p}block_sparse_moe.experts.{e}."
            t |= {m + "w1.weight": rnd(inter, hidden), m + "w3.weight": rnd(inter, hidden),
                  m + "w2.weight": rnd(hidden, inter)}
        save_file(t, str(path / files[i + 1]))
        weight_map.update(dict.fromkeys(t, files[i + 1]))
        del t
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in (REPO / "moec" / "builtin" / "demo-moe").glob("tokenizer*"):
        shutil.copy(f, path)
    return cfg


def _status(key: str) -> int:
    """/proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(model_dir: str, samples: int, seq_len: int, out: str) -> None:
    """The measured run (a fresh process): imports, RSS, calibrate, peak RSS."""
    from moec.calibrate import data, sources
    from moec.calibrate.generic_capture import calibrate_generic
    from moec.calibrate.recipe import parse_recipe

    # the calibration text read and tokenized before the baseline (the tokenizer's batch encoding of PTB train
    # holds ~0.5 GB whatever the model): what is measured is the model's side, which grows with its size
    ids = sources.tokenize(sources.load_tokenizer(Path(model_dir)), data.load_text("ptb", "train"))
    sources.tokenize = lambda tok, text: ids
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM reset to the current RSS: the tokenizer's peak is not ours
    base = _status("VmRSS")
    recipe = parse_recipe({"name": "mem-fp8", "weights": [{"targets": ["experts"], "codec": "fp8", "bits": 8}],
                           "calibration": {"expert_policy": "damped-identity"}})
    t0 = time.time()
    calibrate_generic(Path(model_dir), "random", recipe, "ptb", "train", samples, seq_len, 0, Path(out) / "calib",
                      batch_size=samples)
    Path(out, "child.json").write_text(json.dumps({"rss_after_imports": base, "peak_rss": _status("VmHWM"),
                                                   "seconds": round(time.time() - t0, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "generic_memory_cpu.json"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]), a.child[3])
        return
    with tempfile.TemporaryDirectory(prefix="moec-genmem-") as tmp:
        cfg = build(Path(tmp) / "model", a.hidden, a.inter, a.experts, a.layers)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run([sys.executable, "-m", "benchmarks.bench_generic_memory", "--child", str(Path(tmp) / "model"),
                        str(a.samples), str(a.seq_len), tmp], check=True, cwd=REPO, env=env)
        got = json.loads(Path(tmp, "child.json").read_text())
    D, I, E, V = a.hidden, a.inter, a.experts, 8192
    heads = max(1, D // 128)
    hd, kv = D // heads, max(1, D // 512)
    layer_params = 3 * E * I * D + D * heads * hd * 2 + 2 * D * kv * hd + E * D + 2 * D
    layer_bf16 = 2 * layer_params
    weights = 4 * layer_params + 4 * 2 * V * D  # fp32 as held, plus the global tensors (embedding, LM head)
    hessians = 4 * E * (D * D + I * I)
    acts = 2 * 4 * a.samples * a.seq_len * D + 4 * a.samples * heads * a.seq_len ** 2
    bound = 1.5 * (weights + hessians + acts)
    used = got["peak_rss"] - got["rss_after_imports"]
    rec = {"bench": "generic-memory", "config": {k: cfg[k] for k in ("hidden_size", "intermediate_size",
                                                                      "num_local_experts", "num_hidden_layers")},
           "layer_bytes_bf16": layer_bf16, "samples": a.samples, "seq_len": a.seq_len,
           "weights_fp32_held": weights, "hessians": hessians, "activations": acts, "bound": bound,
           "peak_minus_imports": used, "ratio_to_bound": round(used / bound, 3), "ok": used <= bound,
           "seconds": got["seconds"], "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(rec, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps([rec], indent=1))


if __name__ == "__main__":
    main()
