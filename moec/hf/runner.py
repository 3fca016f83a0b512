"""A transformers causal LM behind the call moec's evaluation and generation loops make of the engine's model
(runtime/perplexity.evaluate, runtime/generate.generate): `model(tokens)` -> logits, `model(tokens, cache, pos)`
with a cache from `cache_factory(model, batch, max_len)`, `.args` (vocab_size, max_seq_len, n_layers), `.layers`,
`.tok_embeddings`. That is how `moec eval` and `moec generate` run the transformers path: an HF directory of a
type moec's engine does not implement, or a layout-"hf" pack (hf/generic.py), with transformers' DynamicCache.

`time_decode` times that path's decode steps for `moec eval --latency` on such a model.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import UserError
from ..formats import checkpoint
from ..runtime.hf_layout import SUPPORTED as ENGINE_TYPES


def model_type(model_dir: Path) -> str | None:
    """The source architecture's model_type of an HF directory or a packed one (whose config.json carries
    moec's own model_type: formats/checkpoint.hf_config_json)."""
    import json

    f = Path(model_dir) / "config.json"
    return checkpoint.source_model_type(json.loads(f.read_text())) if f.is_file() else None


def on_transformers_path(model_dir: Path, path: str = "auto") -> bool:
    """Whether MODEL runs through transformers' modeling code: `path` transformers, a layout-"hf" pack, or (auto)
    an HF directory whose model_type moec's engine does not implement."""
    if path not in ("auto", "engine", "transformers"):
        raise UserError(f"--path must be auto, engine or transformers, got {path!r}")
    if checkpoint.is_packed(model_dir):
        generic = checkpoint.read_manifest(model_dir).get("layout") == "hf"
        if path == "engine" and generic:
            raise UserError(f"{model_dir}: packed on the transformers path (layout hf); moec's engine cannot run it")
        return generic
    if path != "auto":
        return path == "transformers"
    return model_type(model_dir) not in ENGINE_TYPES


class _Cache:
    """One evaluation batch's cache: the one the model makes for itself on its first call (transformers'
    DynamicCache for most types; hybrid and linear-attention types have their own, e.g. MiniMax's; counted as 16
    bits: fp16-held keys and values, as moec's FP16Cache reports) or, for a pack with a KV codec, its MoecCache
    (cache.py), with the bits it stores."""

    def __init__(self, kv: tuple | None = None, max_len: int | None = None):
        self.moec, self.pos = kv is not None, 0  # pos: tokens fed (a hybrid cache may count only some layers)
        if kv is None:
            self.dyn, self.codec = None, "fp16"  # made by the model's first forward (HFRunner.forward)
        else:
            from .cache import MoecCache

            self.dyn = MoecCache(*kv, max_len)
            self.codec = self.dyn.codec
            self.bits_at = lambda tokens: self.dyn.cache.bits_at(tokens)  # the 32k projection eval reports

    def bits_per_element(self) -> float:
        return self.dyn.bits_per_element() if self.moec else 16.0


class HFRunner(nn.Module):
    """A transformers causal LM called as moec's engine model is (module docstring)."""

    def __init__(self, hf: nn.Module, kv: tuple | None = None):
        super().__init__()
        self.hf, self.kv = hf, kv  # kv: (section, kv tensors, attention shapes) of a pack's KV codec
        text = hf.config.get_text_config()
        self.args = SimpleNamespace(vocab_size=text.vocab_size, n_layers=text.num_hidden_layers,
                                    max_seq_len=getattr(text, "max_position_embeddings", 1 << 20),
                                    arch=text.model_type)
        self.layers = hf.model.layers
        self.tok_embeddings = hf.get_input_embeddings()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: _Cache | None = None, start_pos: int = 0) -> torch.Tensor:
        if cache is None:
            return self.hf(input_ids=tokens, use_cache=False).logits
        assert cache.pos == start_pos, (cache.pos, start_pos)
        # positions and the 2-D mask given as generate gives them: a hybrid cache's get_seq_length may count
        # only its attention layers (MiniMax's counts none after its linear layer 0), which the model would
        # otherwise read them from
        B, T = tokens.shape
        pos = torch.arange(start_pos, start_pos + T, device=tokens.device).expand(B, T)
        mask = torch.ones(B, start_pos + T, dtype=torch.long, device=tokens.device)
        out = self.hf(input_ids=tokens, past_key_values=cache.dyn, use_cache=True, position_ids=pos,
                      attention_mask=mask)
        cache.dyn = out.past_key_values  # the first call's: the cache the model makes for itself
        cache.pos += tokens.shape[1]
        return out.logits

    def cache_factory(self, model, batch: int, max_len: int) -> _Cache:
        return _Cache(self.kv, max_len)


def load_runner(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[HFRunner, dict]:
    """(runner, info) for an HF directory or a layout-"hf" pack; info as runtime/loader.load_model's (kind,
    w_bits, manifest) plus `path: transformers`."""
    if checkpoint.is_packed(model_dir):
        from ..runtime.loader import kv_section
        from .load import from_pretrained

        manifest = checkpoint.verify(model_dir)
        hf = from_pretrained(model_dir, device=device, dtype=dtype)
        info = {"kind": "packed", "manifest": manifest, "w_bits": manifest["effective_bits"]["w_bits"],
                "kv": kv_section(manifest)}
    else:
        from transformers import AutoModelForCausalLM

        from .generic import param_groups

        try:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        except (ValueError, KeyError, OSError) as e:
            raise UserError(f"{model_dir}: transformers cannot load it ({str(e).splitlines()[0]})") from None
        groups = param_groups(hf)
        mats = [p for n, p in hf.named_parameters() if groups.get(n) in
                ("experts", "shared_experts", "mlp", "attention", "router") and p.dim() >= 2]
        w_bits = 8.0 * sum(p.numel() * p.element_size() for p in mats) / max(sum(p.numel() for p in mats), 1)
        info = {"kind": "hf", "w_bits": w_bits}
    info["path"] = "transformers"
    kv = None
    if info.get("kv"):  # read once: each evaluation batch gets its own cache over the same tensors
        from ..runtime.config import ModelArgs

        names = [n for n in info["manifest"]["tensors"] if n.startswith("kv.")]
        kv = (info["kv"], checkpoint.load_tensors(model_dir, info["manifest"], names),
              ModelArgs.from_dict(info["manifest"]["hf"]["kv_args"]))
    return HFRunner(hf.eval(), kv), info


@torch.no_grad()
def time_decode(runner: HFRunner, batch: int, context: int, steps: int, device: str) -> dict:
    """ms per decode step of the transformers path at `batch` rows after a `context`-token prefill (random
    tokens; DynamicCache), median and p10/p90 over `steps` steps after 3 warm-up steps."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, runner.args.vocab_size, (batch, context), generator=gen).to(device)
    cache = runner.cache_factory(runner, batch, context + steps + 3)
    runner(x, cache, 0)
    tok = x[:, -1:]
    times = []
    for i in range(steps + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner(tok, cache, context + i)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"ms_median": q(0.5), "ms_p10": q(0.1), "ms_p90": q(0.9), "steps": steps}
