"""The evaluation protocol of docs/benchmarks.md: ppl_tf, ppl_dec, kld and top1 over fixed windows.

Windows are non-overlapping slices of W tokens of the tokenized text. In every window, tokens at
positions CONTEXT..W-1 are scored (the first 32 are context only), in every mode:
  tf  : one forward per window; logits at p predict token p+1.
  dec : prefill the first CONTEXT tokens through the cache, then feed tokens one at a time through
        the (possibly compressed) cache, teacher forced. Windows of a batch decode together, each
        with its own cache row.
With a baseline model the candidate and baseline run in lockstep on the same windows and mode, and
we accumulate KL(p_base || p_cand) and argmax agreement at the same positions. The baseline can also be
its log-probabilities saved by an earlier eval (`saved`, saved_logits.py), and `record` collects the
evaluated model's for saving.
Progress is counted in scored positions (windows × (W − CONTEXT) in all), reported as they are done
and not once per window or batch, so that a long window shows progress inside it: after each decoder
layer of a forward in tf mode (and in simulated decode, one forward per window: layer_progress), after
each position in dec mode. The reporter (moec/progress.py) decides how often that is shown.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .kvcache import FP16Cache, dense_cache
from .model import Transformer

CONTEXT = 32


def make_windows(ids: torch.Tensor, window: int, max_windows: int | None = None,
                 first: int = 0) -> torch.Tensor:
    """Non-overlapping windows [n, W]; a trailing partial window is dropped."""
    n = ids.numel() // window
    w = ids[: n * window].view(n, window)[first:]
    return w if max_windows is None else w[:max_windows]


@dataclass
class Totals:
    nll: float = 0.0
    nll_base: float = 0.0
    kl: float = 0.0
    top1: int = 0
    n: int = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base: torch.Tensor | None) -> None:
        """logits/base: [..., V] for targets [...]; all in fp32 for the sums."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        self.nll += -logp.gather(-1, targets[..., None]).sum().item()
        self.n += targets.numel()
        if base is not None:
            logq = torch.log_softmax(base.float(), dim=-1)
            self.nll_base += -logq.gather(-1, targets[..., None]).sum().item()
            self.kl += (logq.exp() * (logq - logp)).sum().item()
            self.top1 += (logq.argmax(-1) == logp.argmax(-1)).sum().item()

    def result(self, with_base: bool) -> dict:
        out = {"ppl": math.exp(self.nll / self.n), "scored_tokens": self.n}
        if with_base:
            ppl_base = math.exp(self.nll_base / self.n)
            out.update(ppl_base=ppl_base, delta_pct=100.0 * (out["ppl"] / ppl_base - 1.0),
                       kld=self.kl / self.n, top1=self.top1 / self.n)
        return out


def windows_label(n: int, window: int, start: int = CONTEXT) -> str:
    """How a result record names its windows: "8 windows (0-7) of 1024, scored 32..1023"."""
    return f"{n} windows (0-{n - 1}) of {window}, scored {start}..{window - 1}"


@torch.no_grad()
def reference_logits(model: Transformer, windows: torch.Tensor, start: int = CONTEXT) -> list[torch.Tensor]:
    """The reference model's teacher-forced logits [W - start, V] at the scored positions of each window of
    `windows` [n, W] (computed once, then compared against every candidate by score_tf)."""
    return [model(windows[b : b + 1])[0, start - 1 : windows.shape[1] - 1] for b in range(windows.shape[0])]


@torch.no_grad()
def score_tf(model: Transformer, windows: torch.Tensor, base_logits: list[torch.Tensor] | None = None,
             start: int = CONTEXT) -> dict:
    """ppl_tf of `model` over `windows` [n, W], positions start..W-1 scored, one window per forward; with
    `base_logits` (reference_logits of the source model, same windows and start) also ppl_base, delta_pct,
    kld and top1 against them."""
    tot = Totals()
    for b in range(windows.shape[0]):
        x = windows[b : b + 1]
        logits = model(x)[0, start - 1 : x.shape[1] - 1]
        tot.add(logits, x[0, start:], None if base_logits is None else base_logits[b])
    return tot.result(base_logits is not None)


CacheFactory = Callable[[Transformer, int, int], object]


def shares(units: int, parts: int) -> list[int]:
    """`units` split into `parts` integers as even as they go, summing to `units` exactly."""
    return [(i + 1) * units // parts - i * units // parts for i in range(parts)]


@contextmanager
def layer_progress(model: torch.nn.Module, progress: Callable[[int], None] | None, units: int) -> Iterator[None]:
    """While open, every forward of `model` reports `units` to progress(n), a share after each decoder
    layer (model.layers): one forward over a long window (tf, simulated decode) shows progress inside it."""
    layers = list(getattr(model, "layers", None) or [])
    if progress is None or not layers:
        yield
        return
    hooks = [block.register_forward_hook(lambda *_, n=n: progress(n))
             for block, n in zip(layers, shares(units, len(layers)), strict=True) if n]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def fp16_cache(model: Transformer, batch: int, max_len: int) -> FP16Cache:
    dev = model.tok_embeddings.weight.device
    return dense_cache(model.args, batch, max_len, dtype=torch.float16, device=dev)


@torch.no_grad()
def evaluate(model: Transformer, windows: torch.Tensor, mode: str, baseline: Transformer | None = None,
             batch_size: int = 4, cache_factory: CacheFactory = fp16_cache,
             progress: Callable[[int], None] | None = None, saved=None, record=None) -> dict:
    """Perplexity (and kld/top1 against `baseline`) over `windows` [n, W] in mode 'tf' or 'dec'.

    saved(mode, rows, cols) -> baseline log-probs [rows, cols, V] (saved_logits.SavedLogits) replaces
    `baseline`; record(mode, rows, cols, logits) receives the model's logits at the scored positions.
    progress(n): n more scored positions done (the module docstring says when), n·(W − CONTEXT) in all."""
    assert mode in ("tf", "dec"), mode
    assert baseline is None or saved is None, "one baseline"
    with_base = baseline is not None or saved is not None
    n, W = windows.shape
    assert W > CONTEXT + 1, f"window {W} must exceed the {CONTEXT}-token context"
    dev = model.tok_embeddings.weight.device
    tot, kv_bits = Totals(), []
    for s in range(0, n, batch_size):
        batch = windows[s : s + batch_size].to(dev)
        B = batch.shape[0]
        if mode == "tf":
            for b in range(B):  # one window at a time keeps [W, V] logits small
                x = batch[b : b + 1]
                with layer_progress(model, progress, W - CONTEXT):  # the window's positions, layer by layer
                    logits = model(x)[0, CONTEXT - 1 : W - 1]
                base = baseline(x)[0, CONTEXT - 1 : W - 1] if baseline is not None else None
                if saved is not None:
                    base = saved(mode, slice(s + b, s + b + 1), slice(None))[0].to(dev)
                if record is not None:
                    record(mode, slice(s + b, s + b + 1), slice(None), logits[None])
                tot.add(logits, x[0, CONTEXT:], base)
        else:
            cache = cache_factory(model, B, W)
            # the baseline: fp16 KV (its own cache_factory where it has one: a transformers-path model)
            bcache = (getattr(baseline, "cache_factory", None) or fp16_cache)(baseline, B, W) if baseline is not None \
                else None
            rows = slice(s, s + B)
            sbase = saved(mode, rows, slice(None)).to(dev) if saved is not None else None  # [B, W - CONTEXT, V]
            logits = model(batch[:, :CONTEXT], cache, 0)[:, -1]
            base = baseline(batch[:, :CONTEXT], bcache, 0)[:, -1] if baseline is not None else None
            if sbase is not None:
                base = sbase[:, 0]
            if record is not None:
                record(mode, rows, slice(0, 1), logits[:, None])
            tot.add(logits, batch[:, CONTEXT], base)
            if progress is not None:  # every position of every window of the batch, as it is decoded
                progress(B)
            for t in range(CONTEXT, W - 1):
                x = batch[:, t : t + 1]
                logits = model(x, cache, t)[:, -1]
                base = baseline(x, bcache, t)[:, -1] if baseline is not None else None
                k = t - CONTEXT + 1  # the scored position's row
                if sbase is not None:
                    base = sbase[:, k]
                if record is not None:
                    record(mode, rows, slice(k, k + 1), logits[:, None])
                tot.add(logits, batch[:, t + 1], base)
                if progress is not None:
                    progress(B)
            kv_bits.append(cache.bits_per_element())
            if hasattr(cache, "bits_at"):  # tiered caches: the stored-byte formula projected to 32k tokens
                out_32k = cache.bits_at(32768)
    out = tot.result(with_base)
    out["windows"] = n
    out["window_len"] = W
    if kv_bits:
        out["kv_bits"] = sum(kv_bits) / len(kv_bits)
        out["kv_codec"] = getattr(cache, "codec", "fp16")
        out["kv_bits_32k"] = out_32k if hasattr(cache, "bits_at") else 16.0
    return out
