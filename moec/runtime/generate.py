"""Text generation: prefill the prompt, then decode one token at a time (greedy or sampled).

The loop takes the static decode engine (moec/runtime/decode.py: CUDA graphs on the GPU) for the
caches it holds (fp16, kivi, nuq-outlier) and otherwise the dynamic cache a packed checkpoint names
(loader.kv_cache_factory: latent and RVQ codecs), through `Transformer.forward(tokens, cache, pos)`.
Either way it runs whatever expert codec the checkpoint carries (the MoE layer's codec hook).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .decode import DecodeEngine, make_cache
from .kvcache import dense_cache
from .model import Transformer


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """Next token from logits [V]: argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=gen))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int] | torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             kv: dict | None = None, codecs: list | None = None, cache_factory=None, static_cache=None,
             eos_id: int | None = None,
             on_token: Callable[[int], None] | None = None, seed: int = 0, graphs: bool | None = None,
             kv_dtype: torch.dtype = torch.float16, engine: bool | None = None) -> list[int]:
    """Generated token ids (prompt excluded). kv/codecs: a checkpoint's KV section and per-layer codecs
    (None: fp16 cache); static_cache: the static engine's cache builder (decode.static_cache_factory), in
    place of kv/codecs; cache_factory: a dynamic cache (model, batch, max_len) instead of the static
    engine; kv_dtype: the dtype of an uncompressed cache (fp32 for exact comparisons)."""
    ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
    assert ids.numel() > 0, "empty prompt"
    max_len = ids.numel() + max_new_tokens
    if max_len > model.args.max_seq_len:
        raise ValueError(f"prompt ({ids.numel()}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{model.args.max_seq_len} tokens")
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []

    def emit(t: int) -> bool:
        out.append(t)
        if on_token is not None:
            on_token(t)
        return (eos_id is not None and t == eos_id) or len(out) >= max_new_tokens

    if max_new_tokens <= 0:
        return out
    static = engine if engine is not None else cache_factory is None
    if static:
        max_len = -(-max_len // 128) * 128  # whole chunks for the GPU's split attention (kvcache.SPLIT)
        max_len = min(max_len, model.args.max_seq_len)
        cache = static_cache(model, 1, max_len) if static_cache else make_cache(model, 1, max_len, kv, codecs)
        if not kv and static_cache is None:
            cache = dense_cache(model.args, 1, max_len, device=cache.device, dtype=kv_dtype, mode="static")
        eng = DecodeEngine(model, cache, graphs=graphs)
        logits = eng.prefill(0, ids)
        while not emit(t := pick(logits, temperature, gen)):
            eng.tokens[0] = t
            logits = eng.step(1)[0]
        return out
    dev = model.tok_embeddings.weight.device
    cache = cache_factory(model, 1, max_len)
    logits = model(ids[None].to(dev), cache, 0)[0, -1]
    pos = ids.numel()
    while not emit(t := pick(logits, temperature, gen)):
        logits = model(torch.tensor([[t]], device=dev), cache, pos)[0, -1]
        pos += 1
    return out


def runtime_generate(model: Transformer, info: dict, prompt, max_new_tokens: int, **kw) -> list[int]:
    """`generate` with the KV codec a loaded checkpoint records (loader.load_model's info)."""
    section = info.get("kv")
    if not section:
        return generate(model, prompt, max_new_tokens, **kw)
    from .decode import static_cache_factory

    # every registered KV codec runs in the static engine
    factory = static_cache_factory(section, info.get("kv_tensors", {}), model.args)
    return generate(model, prompt, max_new_tokens, kv=section, static_cache=factory, **kw)
