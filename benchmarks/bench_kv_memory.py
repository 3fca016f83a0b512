"""KV-cache memory at the Mixtral-8x7B attention shape: bytes per token per codec, and the largest batch
that fits at 128k tokens on one H200, for the fp16 cache against each codec (pure CPU arithmetic).

Bytes are measured, not derived from a formula: each codec encodes one 32-token block of random
keys/values of shape [1, 8 KV heads, 32, 128] (per layer, keys and values) and we sum the bytes of
the tensors it returns (codes, scales, zero points, outlier indices and values); per-layer statics
(scales, levels, centers) are summed from the codec; the fp16 window and sinks count at 2 bytes per
element, as TieredKVCache.stored_bytes does. A TieredKVCache of the same shape then gives the same
per-block bytes from its buffers (checked), and bytes at T tokens follow its eviction rule.

Largest batch at 128k: floor((HBM − weights − reserve) / KV bytes of one 128k sequence), for the
weights of Mixtral-8x7B in bf16 (46.7e9 parameters, 93.4 GB) and with 2-bit experts (moec HLS-2,
2.25 bits per expert weight with its scales; attention, router and embeddings bf16).

    python3 -m benchmarks.bench_kv_memory     # writes benchmarks/results/kv_memory.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from moec.cli.common import base_record, write_json_atomic
from moec.runtime.config import ModelArgs
from moec.runtime.kivi import KIVICodec
from moec.runtime.kvtiered import TieredKVCache
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec

ROOT = Path(__file__).resolve().parents[1]

L, K, D = 32, 8, 128  # Mixtral-8x7B: layers, KV heads, head_dim
BLOCK, WINDOW = 32, 128
HBM = 141e9  # one H200 (bytes)
RESERVE = 4e9  # activations, workspace, CUDA context
# Mixtral-8x7B parameters: experts 32 layers × 8 experts × 3 × 4096 × 14336; the rest attention,
# router, norms, embeddings and lm_head (46.70e9 in all)
EXPERT_PARAMS = 32 * 8 * 3 * 4096 * 14336
TOTAL_PARAMS = 46.70e9
WEIGHTS = {"bf16": 2 * TOTAL_PARAMS,
           "hls2-experts": EXPERT_PARAMS * 2.25 / 8 + 2 * (TOTAL_PARAMS - EXPERT_PARAMS)}


def codecs_for(name: str) -> tuple[list, int]:
    """(per-layer codecs, sinks) of each recipe's settings at the Mixtral shape."""
    if name.startswith("kivi"):
        return [KIVICodec(int(name[-1]), D, 32) for _ in range(L)], 0
    bits, frac = (2, 0.008) if name == "nuq2-outlier" else (3, 0.01)
    lev = torch.tensor(FIXED_LEVELS[bits])
    ones = torch.ones(K, D)
    return [NUQCenteredCodec(bits, D, BLOCK, lev, lev, ones, frac, k_center=0 * ones, k_weight=ones)
            for _ in range(L)], 4


def measure(name: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    if name == "fp16":
        per_token = L * 2 * K * D * 2
        return {"codec": name, "block_bytes": BLOCK * per_token, "static_bytes": 0, "sinks": 0,
                "bytes_per_token_history": per_token, "bytes_at": {}, "cache": None}
    codecs, sinks = codecs_for(name)
    block_bytes = 0
    for c in codecs:  # encode one block of random K/V per layer and sum what is stored
        for kind in "kv":
            x = torch.randn(1, K, BLOCK, D, generator=g) * torch.rand(1, K, 1, D, generator=g) * 4
            block_bytes += sum(t.numel() * t.element_size() for t in c.encode(x, kind).values())
    static = sum(t.numel() * t.element_size() for c in codecs for t in c.static_tensors().values())
    args = ModelArgs(arch="llama", vocab_size=8, dim=K * D, n_layers=L, n_heads=4 * K, n_kv_heads=K, head_dim=D,
                     max_seq_len=256)
    cache = TieredKVCache(args, 1, 256, codecs, window=WINDOW, sinks=sinks, block=BLOCK)
    assert cache._block_bytes() == block_bytes and cache._static_bytes() == static, (name, block_bytes)
    return {"codec": name, "block_bytes": block_bytes, "static_bytes": static, "sinks": sinks,
            "bytes_per_token_history": block_bytes / BLOCK, "cache": cache}


def bytes_at(m: dict, tokens: int) -> float:
    """KV bytes of one sequence of `tokens` tokens (window, sinks, history blocks, statics)."""
    fp16_token = L * 2 * K * D * 2
    if m["cache"] is None:
        return tokens * fp16_token
    nb = m["cache"].blocks_at(tokens)
    return nb * m["block_bytes"] + (tokens - nb * BLOCK) * fp16_token + m["static_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_memory.json")
    a = ap.parse_args()
    records = []
    fp16_128k = None
    for name in ("fp16", "kivi-4", "kivi-2", "nuq3-outlier", "nuq2-outlier"):
        m = measure(name)
        at = {t: bytes_at(m, t) for t in (4096, 32768, 131072)}
        fp16_128k = fp16_128k or at[131072]
        batches = {w: math.floor((HBM - wb - RESERVE) / at[131072]) for w, wb in WEIGHTS.items()}
        rec = base_record("kv_memory", "cpu (arithmetic)") | {
            "shape": f"Mixtral-8x7B attention: {L} layers, {K} KV heads, head_dim {D}", "method": name,
            "recipe": {"fp16": "fp16", "kivi-4": "kv-kivi4", "kivi-2": "kv-kivi2", "nuq3-outlier": "kv-nuq3-outlier",
                       "nuq2-outlier": "kv-nuq2-outlier"}[name],
            "context": 131072, "batch": 1, "window": 0 if name == "fp16" else WINDOW, "sinks": m["sinks"],
            "block_bytes_all_layers": m["block_bytes"], "static_bytes": m["static_bytes"],
            "bytes_per_token_history": m["bytes_per_token_history"],
            "bytes_per_token": {str(t): b / t for t, b in at.items()},
            "kv_bits": {str(t): 8 * b / (t * L * 2 * K * D) for t, b in at.items()},
            "gb_per_sequence_128k": at[131072] / 1e9, "compression_vs_fp16_128k": fp16_128k / at[131072],
            "max_batch_128k": batches,
            "assumptions": {"hbm_bytes": HBM, "reserve_bytes": RESERVE, "weights_bytes": WEIGHTS,
                            "note": "bf16: all 46.7e9 parameters at 2 bytes; hls2-experts: expert weights "
                                    "at 2.25 bits (2-bit codes + group scales), the rest bf16"}}
        records.append(rec)
        print(name, {k: rec[k] for k in ("bytes_per_token", "kv_bits", "gb_per_sequence_128k", "max_batch_128k")})
    write_json_atomic(a.out, records)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
