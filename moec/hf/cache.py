"""`MoecCache`: a transformers `Cache` holding the KV codec a moec packed checkpoint names, so that
`model.generate(..., past_key_values=MoecCache.from_packed(PACKED_DIR))` decodes through the compressed cache.

Shape legend: B = batch, H = query heads, K = KV heads, T = new tokens, S = tokens attended over, d = head dim.

It plugs in as transformers' QuantizedCache does: `update(k, v, layer)` stores the new post-RoPE keys and
values and returns what attention runs over. It re-implements nothing of the cache: it wraps the codec
family's own cache in its dynamic mode (runtime/kvtiered.TieredKVCache or the RVQ family's subclass, built by
runtime/loader.kv_cache_factory from the manifest's `kv` section and `kv.*` tensors): fp16 sinks and window,
the older blocks encoded by the codec, returned dequantized in position order (`TieredKVCache.read_append`,
the same view `attend` takes), and the history attention is the cache's `attend_history`. Keys
encoded pre-RoPE (`rope: pre`) are un-rotated and rotated back inside moec's cache, so transformers
always sees post-RoPE keys; head_dim rotations (nuq-outlier and kivi `rotate: hadamard`) are undone on the way out.

One thing keys and values cannot carry: nuq-outlier's `score_bias` (a bias on the history scores, a function
of the query in the codec's basis: runtime/kvtiered.history_bias).
For it `update` tags the keys it returns, and the attention function `moec_attention` (registered as
attn_implementation "moec", which moec.hf's loaders select) hands them to the cache's `attend_history`;
without it the bias would be dropped, so the next `update` of that layer raises.
A family whose queries do not all see one view in position order (`position_order_view` False: the latent
codecs attend per query over group-encoded blocks, an order no causal mask expresses) is refused by
`from_packed` with a message.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import UserError
from ..formats import checkpoint
from ..runtime.config import ModelArgs
from ..runtime.kvtiered import TieredKVCache
from ..runtime.loader import kv_cache_factory, kv_section
from ..runtime.model import sdpa

ATTENTION = "moec"
_TAG = "_moec_history"  # attribute update() sets on the keys it returns: (cache, layer, s, h)


def _shim(args: ModelArgs, device) -> SimpleNamespace:
    """What the cache factories read of a moec model: its args and its device."""
    return SimpleNamespace(args=args, tok_embeddings=SimpleNamespace(weight=torch.empty(0, device=device)))


class MoecLayer(DynamicLayer):
    """One layer's view of the shared moec cache (transformers asks each layer for its length)."""

    is_croppable = False

    def __init__(self, owner: MoecCache, layer: int):
        super().__init__()
        self.owner, self.layer, self.seen = owner, layer, 0
        self.last_tagged = None  # keys returned with a score-bias tag, until attention marks them used

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.last_tagged is not None and not getattr(self.last_tagged, "_moec_used", False):
            raise RuntimeError(f"MoecCache: the {self.owner.codec} codec adds a score bias to its history, which "
                               f"attention '{ATTENTION}' applies; load the model with moec.hf (it selects it) or "
                               f"call model.set_attn_implementation('{ATTENTION}')")
        cache = self.owner.moec_cache(key_states)
        keys, values, (s, h) = cache.read_append(self.layer, key_states, value_states, self.seen, key_states.dtype)
        self.seen += key_states.shape[-2]
        self.last_tagged = None
        if h and cache.history_biased(self.layer):
            setattr(keys, _TAG, (cache, self.layer, s, h))
            self.last_tagged = keys
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.owner.max_len

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("MoecCache: beam search is not supported (one sequence per batch row)")

    def reset(self) -> None:
        raise NotImplementedError("MoecCache: make a new cache (MoecCache.from_packed) per generation")


class MoecCache(Cache):
    """The compressed KV cache of a moec packed checkpoint as a transformers Cache (see the module docstring).
    Built lazily at the first update, for that call's batch size and device; one cache per generation."""

    def __init__(self, section: dict, kv_tensors: dict[str, torch.Tensor], args: ModelArgs,
                 max_len: int | None = None):
        self.codec, self.args = section["codec"], args
        self.max_len = max_len or args.max_seq_len
        self.make = kv_cache_factory({"kv": section, "kv_tensors": kv_tensors}, args)  # checks the section
        if args.is_mla:  # transformers' DeepSeek attention hands update() per-head keys, never the latent
            raise UserError(f"MoecCache: KV codec {self.codec!r} holds the MLA latent, which transformers' attention "
                            f"decompresses per head before the cache sees it; use moec's runtime (moec generate / "
                            f"moec.runtime.generate) for it")
        probe = self.make(_shim(args, "cpu"), 1, min(self.max_len, section.get("block", 32) + 1))
        if not isinstance(probe, TieredKVCache) or not probe.position_order_view:
            raise UserError(f"MoecCache: KV codec {self.codec!r} attends per query over layer-group blocks, "
                            f"which transformers' update()/attention split cannot express; use moec's runtime "
                            f"(moec generate / moec.runtime.generate) for it")
        self.cache: TieredKVCache | None = None
        super().__init__(layers=[MoecLayer(self, i) for i in range(args.n_layers)])

    @classmethod
    def from_packed(cls, path: str | Path, max_len: int | None = None) -> MoecCache:
        """The cache of packed checkpoint `path`'s KV codec (runtime/loader.kv_section and the `kv.*` tensors),
        for up to `max_len` tokens per row (the model's context by default: history buffers are allocated up
        front, so a smaller bound saves memory). UserError for a checkpoint without a KV codec."""
        manifest = checkpoint.verify(path)
        if not manifest.get("kv"):
            raise UserError(f"{path}: the checkpoint keeps an fp16 KV cache (no KV codec); use transformers' "
                            f"DynamicCache")
        names = [n for n in manifest["tensors"] if n.startswith("kv.")]
        tensors = checkpoint.load_tensors(path, manifest, names)
        # a transformers-path pack (layout hf) records the attention shapes as hf.kv_args (hf/generic.kv_args)
        args = manifest["model_args"] if "model_args" in manifest else (manifest.get("hf") or {}).get("kv_args")
        return cls(kv_section(manifest), tensors, ModelArgs.from_dict(args), max_len)

    def moec_cache(self, key_states: torch.Tensor) -> TieredKVCache:
        B = key_states.shape[0]
        if self.cache is None:
            self.cache = self.make(_shim(self.args, key_states.device), B, self.max_len)
        if (B, key_states.device) != (self.cache.batch, self.cache.device):
            raise ValueError(f"MoecCache: built for batch {self.cache.batch} on {self.cache.device}, got batch {B} "
                             f"on {key_states.device}; use one cache per generation")
        return self.cache

    def bits_per_element(self) -> float:
        """Effective KV bits of what the cache holds now (moec's stored-byte formula, docs/benchmarks.md)."""
        return self.cache.bits_per_element() if self.cache is not None else 0.0


def moec_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                   dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention, or, for keys a MoecCache tagged, the moec cache's own history attention
    (`attend_history`: the history score bias added) (query [B, H, T, d], key/value [B, K, S, d] ->
    ([B, T, H, d], None)); SDPA unchanged for every other call."""
    tag = getattr(key, _TAG, None)
    sinks = kwargs.pop("s_aux", None)
    if tag is None and sinks is not None:  # gpt-oss's learned sinks, which SDPA's forward would drop
        return _attention_with_sinks(query, key, value, attention_mask, scaling, sinks)
    if tag is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    key._moec_used = True
    cache, layer, s, h = tag
    d, S, T = query.shape[-1], key.shape[2], query.shape[2]
    if scaling is not None and abs(scaling - d**-0.5) > 1e-6 * d**-0.5:
        # the cache attends with scores q·k/sqrt(d) (its history score bias is a function of those scores'
        # query): a model's own scale (granite's attention_multiplier) is the same scores for q·scaling·sqrt(d)
        query = query * (scaling * d**0.5)
    out = cache.attend_history(layer, query, key, value, s, h, S - T,
                               None if attention_mask is None else attention_mask[..., :S], q_rotated=False)
    return out.transpose(1, 2).contiguous(), None


def _attention_with_sinks(query, key, value, attention_mask, scaling, sinks):
    """Attention with a learned logit per query head in the softmax's denominator (gpt-oss's `s_aux`), as its
    eager attention computes it (runtime/model.sdpa; the mask, a sliding window's included, applies to the real
    keys; transformers' float masks are 0 where a key is seen) -> ([B, T, H, d], None)."""
    T, S = query.shape[2], key.shape[2]
    if attention_mask is None:
        allowed = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(diagonal=S - T)
    else:
        allowed = attention_mask[..., :S]
        allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    out = sdpa(query, key, value, allowed, scaling, sinks.view(-1, 1))
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION, moec_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
