"""Per-tensor storage codecs of the packed checkpoint (the `codec` field of each manifest entry)."""

from __future__ import annotations

import re
from enum import StrEnum


class WeightCodec(StrEnum):
    """How a weight tensor is stored.

    KEEP: the tensor as-is, in its source dtype and canonical shape (the identity recipe), so a
    packed copy reproduces the source bit for bit.
    """

    KEEP = "keep"


# Which canonical tensors count as "weights" for effective bits: every matrix inside the decoder
# layers (attention projections, router, experts, shared experts, dense MLPs). Norms, biases,
# embeddings and the LM head are reported apart, since no recipe here compresses them.
WEIGHT_PATTERN = re.compile(r"layers\.\d+\.(attn\.w[qkvo]\.weight|moe\.(router\.weight|w[123]|shared\..*weight|"
                            r"shared_gate\.weight))$")

# Named groups a recipe rule can target (DESIGN.md: experts, shared_experts, mlp, attention, lm_head).
TARGET_PATTERNS = {
    "experts": r"layers\.\d+\.moe\.w[123]$",  # stacked experts of MoE layers (see `is_dense` below)
    "mlp": r"layers\.\d+\.moe\.w[123]$",  # dense MLPs are stored as one always-taken expert
    "shared_experts": r"layers\.\d+\.moe\.shared\.w[123]\.weight$",
    "attention": r"layers\.\d+\.attn\.w[qkvo]\.weight$",
    "router": r"layers\.\d+\.moe\.(router|shared_gate)\.weight$",
    "lm_head": r"(output|tok_embeddings)\.weight$",
}
