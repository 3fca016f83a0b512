"""`moec export`: a packed checkpoint rewritten in a format other runtimes read, only where the mapping is
exact (the other runtime's dequantization gives bit for bit the weights moec's `dequant_ref` gives).

    gguf  llama.cpp (export/to_gguf.py): rtn 4-bit, groups of 32, fp16 scale and zero -> Q4_1
          (w = d·q + m with d = scale, m = zero); intsym 4-/8-bit, groups of 32 -> Q4_0 / Q8_0 (w = d·q);
          kept tensors as F32/F16/BF16; the tokenizer with its pre-tokenizer mapped. Llama and Mixtral only.
    ct    compressed-tensors, an HF directory in the layout vLLM reads (export/to_ct.py): intsym ->
          `pack-quantized` (int, symmetric, group or channel: W4A16 / W8A16); rtn whose zero is an integer
          multiple of its scale -> `pack-quantized` (int, asymmetric); fp8 -> `float-quantized` (e4m3,
          channel); kept tensors as they are.
    fp4   mxfp4 -> GGUF MXFP4 (e8m0 byte + 16 bytes of codes per 32 weights); nvfp4 -> compressed-tensors
          `nvfp4-pack-quantized` (packed e2m1, e4m3 block scales, the fp32 global scale; power-of-two global
          scales, so the library's bf16 decode is exact).

Anything else (hls, fp3 and vq codebooks, other group sizes or bits for GGUF, rtn with a fractional
zero for ct, fp8 for GGUF) is a UserError naming the tensor, its codec and the formats that can carry it.
KV codecs: fp8 (static per-layer scales) -> ct `kv_cache_scheme` (float 8-bit, strategy tensor) with
`self_attn.k_scale` / `v_scale` per layer, what vLLM's fp8 KV cache loads. Every other KV codec is a
runtime setting of moec that no format here carries: the export holds the weights, and a warning says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)
FORMATS = ("gguf", "ct")


def export(packed: str | Path, fmt: str, out: str | Path) -> dict:
    """Write the export of `packed` in format `fmt` to the directory `out`; returns its summary."""
    from ..errors import UserError
    from .source import PackedModel
    from .to_ct import kv_ct_hook

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    model = PackedModel(packed)
    if model.kv_codec is not None and not (fmt == "ct" and kv_ct_hook(model) is not None):
        log.warning("the KV codec %s is a runtime setting of moec: --format %s does not carry it (the export "
                    "holds the weights)", model.kv_codec, fmt)
    if fmt == "gguf":
        from .to_gguf import write_gguf

        return write_gguf(model, Path(out))
    from .to_ct import write_ct

    return write_ct(model, Path(out))
