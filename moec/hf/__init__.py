"""transformers adapters for moec packed checkpoints (this package may import transformers; moec.runtime may not).

    import moec.hf                                   # registers quant_method "moec" and attention "moec"
    model = AutoModelForCausalLM.from_pretrained(PACKED_DIR, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=64, past_key_values=moec.hf.MoecCache.from_packed(PACKED_DIR))

`moec.hf.from_pretrained(PACKED_DIR, device=...)` loads any packed checkpoint, those packed before the
shard index (model.safetensors.index.json) that transformers' loader needs included. Loading: load.py;
the compressed KV cache: cache.py.
"""

from .cache import MoecCache, moec_attention
from .load import MoecConfig, MoecHfQuantizer, attach_packed, from_pretrained

__all__ = ["MoecCache", "MoecConfig", "MoecHfQuantizer", "attach_packed", "from_pretrained", "moec_attention"]
