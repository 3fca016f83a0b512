"""Every MoE type of moec.hf.tiny (one tiny random config per text causal-LM MoE type of transformers, with its
special layers) through the transformers path, in process (moec/hf/coverage.check_in_process): the identity
pack's logits equal the source's (<= 1e-5 relative, fp32), a calibrated rtn 4-bit pack of experts and every
linear equals the source with those matrices dequantized (<= 1e-4), and so does AutoModelForCausalLM's load of
it after `import moec.hf`. The CLI chain per type (calibrate → pack → eval → generate) is
benchmarks/bench_coverage.py's (results/coverage.json), not CI's.
"""

from __future__ import annotations

import pytest

from moec.hf import coverage
from moec.hf.tiny import MULTIMODAL_FAMILY, TINY_TYPES


def test_at_least_25_text_types():
    assert len(set(TINY_TYPES) - set(MULTIMODAL_FAMILY)) >= 25  # text-only causal LMs (issue 33's count)


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_type_through_the_transformers_path(model_type, tmp_path, short_ptb):
    r = coverage.check_in_process(model_type, tmp_path)
    assert r["identity"] <= coverage.IDENTITY_BOUND, r
    assert r["quant"] <= coverage.QUANT_BOUND and r["auto"] <= coverage.QUANT_BOUND, r
    assert r["quantized_params"] > 0, r
