"""Retrieval through a compressed KV cache (benchmarks/bench_retrieval.py, docs/benchmarks.md "Retrieval"):
the seeded passkey and multi-key needle trials, a prefill computed once and handed to every recipe's cache,
the question and greedy answer through that cache, and the intervals the records carry.

One prefill per trial serves every recipe: `PrefillRecorder` runs as the model's cache for the
haystack and keeps each layer's post-RoPE keys and values; `load_prefill` hands them to a recipe's cache,
which stores them as its own prefill would (the window ages into the encoded history); `answer` feeds the
question as one chunk and decodes greedily through that cache. `KeysValuesApart` pairs the keys of one
calibrated tiered codec with the values of another (keys at higher precision than values, KIVI's finding)
so the benchmark measures that split without a new codec.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NAMES = ("Alice", "Bob", "Carol", "David")
TASKS = {
    "passkey": {"needle": " The pass key is {key}. Remember it. {key} is the pass key. ",
                "question": "\n\nWhat is the pass key? The pass key is"},
    "needle": {"needle": " {name}'s pass key is {key}. Remember it. {key} is {name}'s pass key. ",
               "question": "\n\nWhat is {name}'s pass key? {name}'s pass key is"},
}
QUESTION_MAX, NEW_TOKENS = 24, 8
RESERVE = QUESTION_MAX + NEW_TOKENS  # the haystack is length - RESERVE tokens


# -- trials -------------------------------------------------------------------------------------------------

def plan(task: str, n: int, seed: int, n_keys: int = 2) -> list[dict]:
    """The seeded trials of `task`: keys, depths (fractions of the allowed span), the asked name. The same
    for every recipe and length (a depth is placed per length)."""
    rng = random.Random(f"{task}:{seed}")
    out = []
    for i in range(n):
        if task == "passkey":
            out.append({"keys": [rng.randrange(10000, 100000)], "depths": [(i + rng.random()) / n],
                        "names": [None], "asked": 0})
        else:
            keys = rng.sample(range(10000, 100000), n_keys)
            depths = sorted(rng.random() for _ in range(n_keys))
            out.append({"keys": keys, "depths": depths, "names": list(rng.sample(NAMES, n_keys)),
                        "asked": rng.randrange(n_keys)})
    return out


def build(tok, task: str, trial: dict, length: int, lo: int, guard: int) -> tuple[list[int], list[int], list[int]]:
    """(haystack ids of exactly length - RESERVE tokens, question ids, token positions of the needles).
    Needles start at token lo.. and end before haystack - guard; filler is cut at whole sentences except
    the haystack's last one."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    t = TASKS[task]
    n = length - RESERVE
    intro, sent = enc(INTRO), enc(FILLER)
    needles = [enc(t["needle"].format(key=k, name=d)) for k, d in zip(trial["keys"], trial["names"], strict=True)]
    # a needle starts at the first sentence boundary at or after its target, at most one sentence later
    span = n - guard - sum(map(len, needles)) - max(lo, len(intro)) - len(sent) * len(needles)
    if span <= 0:
        raise ValueError(f"length {length} leaves no room for the needles before the guard ({guard} tokens)")
    ids, pos = list(intro), []
    for d, nd in zip(trial["depths"], needles, strict=True):
        target = max(lo, len(intro)) + int(d * span)
        while len(ids) < target:
            ids += sent
        pos.append(len(ids))
        ids += nd
    while len(ids) < n:
        ids += sent
    name = trial["names"][trial["asked"]]
    q = enc(t["question"].format(name=name))
    assert len(q) <= QUESTION_MAX, len(q)
    return ids[:n], q, pos


# -- statistics ---------------------------------------------------------------------------------------------

Z = 1.959963984540054


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson score 95% interval of k successes in n trials, as proportions."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + Z * Z / n
    mid = (p + Z * Z / (2 * n)) / den
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def paired_diff(a: list[bool], b: list[bool]) -> tuple[float, float, float]:
    """p_b - p_a over paired trials with Newcombe's (1998) hybrid score interval, method 10."""
    n = len(a)
    n11 = sum(x and y for x, y in zip(a, b, strict=True))
    n10 = sum(x and not y for x, y in zip(a, b, strict=True))
    n01 = sum(y and not x for x, y in zip(a, b, strict=True))
    n00 = n - n11 - n10 - n01
    pa, pb = (n11 + n10) / n, (n11 + n01) / n
    la, ua = wilson(n11 + n10, n)
    lb, ub = wilson(n11 + n01, n)
    den = (n11 + n10) * (n01 + n00) * (n11 + n01) * (n10 + n00)
    num = n11 * n00 - n10 * n01
    if den == 0:
        phi = 0.0
    else:  # the continuity-corrected phi Newcombe uses, floored at 0
        phi = (max(abs(num) - n / 2, 0) * (1 if num >= 0 else -1)) / math.sqrt(den)
    d = pb - pa
    lo = d - math.sqrt(max(0.0, (pb - lb) ** 2 - 2 * phi * (pb - lb) * (ua - pa) + (ua - pa) ** 2))
    hi = d + math.sqrt(max(0.0, (ub - pb) ** 2 - 2 * phi * (ub - pb) * (pa - la) + (pa - la) ** 2))
    return d, max(-1.0, lo), min(1.0, hi)


# -- the shared prefill and the answer --------------------------------------------------------------------

class PrefillRecorder:
    """A cache for one causal prefill from position 0 that keeps each layer's post-RoPE keys and values (the
    model hands them to `attend`). It attends over the keys and values rounded to fp16, as the fp16 cache
    and the tiered caches' own prefills do (their window is fp16), so the recorded prefill equals theirs; a
    cache with head_dim rotations rounds in the rotated basis instead (logits within ~1e-3:
    tests/runtime/test_retrieval.py, and `--check-prefill` counts answers that differ)."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q, k, v, start_pos: int = 0):
        assert start_pos == 0
        self.k[layer], self.v[layer] = k, v
        k16, v16 = k.half().to(q.dtype), v.half().to(q.dtype)  # is_causal: the CPU's flash path skips the
        return F.scaled_dot_product_attention(q, k16, v16, is_causal=True, enable_gqa=True)  # masked half


def load_prefill(cache, rec: PrefillRecorder, n_layers: int, n_heads: int) -> None:
    """Store the recorded prefill in `cache` as its own prefill would (the window ages into the history):
    each layer's `attend` gets every key/value and one query (its output is not used), so the cache's
    encoding runs and the quadratic attention does not; a cache with head_dim rotations (which rotate q, k
    and v together) stores them through `read_append`, the store-only entry of transformers' Cache."""
    for layer in range(n_layers):
        k, v = rec.k[layer], rec.v[layer]
        if getattr(cache, "rot", None) is not None:  # head_dim rotations wrap q, k, v of one length: store only
            cache.read_append(layer, k, v, 0, k.dtype)
            continue
        # one query where every query attends over one view in position order; a family whose queries see
        # per-query views (the latent cache's groups) masks per query: all queries, the quadratic cost included
        n = 1 if getattr(cache, "position_order_view", True) else k.shape[2]
        q = torch.zeros(k.shape[0], n_heads, n, k.shape[3], dtype=k.dtype, device=k.device)
        cache.attend(layer, q, k, v, 0)


@torch.no_grad()
def answer(model, cache, question: torch.Tensor, start: int) -> list[list[int]]:
    """Feed the question chunk [B, T] at `start`, then NEW_TOKENS greedy steps -> the tokens per row."""
    logits = model(question, cache, start)[:, -1]
    pos, out = start + question.shape[1], []
    for _ in range(NEW_TOKENS):
        t = logits.argmax(-1)
        out.append(t)
        logits = model(t[:, None], cache, pos)[:, -1]
        pos += 1
    return torch.stack(out, 1).tolist()


class KeysValuesApart:
    """A tiered block codec with the keys of one calibrated codec and the values of another (same window,
    sinks, block and head_dim rotation): keys at higher precision than values, KIVI's finding, measured
    without a new codec. The torch path only (no fused kernel reads two bit widths)."""

    fused_decode_attention = False

    def __init__(self, keys, values):
        rk, rv = getattr(keys, "rotation", None), getattr(values, "rotation", None)
        if (rk is None) != (rv is None) or (rk is not None and not torch.equal(rk, rv)):
            raise ValueError("mixed K/V recipes must share their head_dim rotation (same rotate and seed)")
        self.keys, self.values = keys, values
        self.name, self.bits, self.n_out = f"{keys.name}+{values.name}", keys.bits, 0
        self.rotation, self.k_err2 = rk, getattr(keys, "k_err2", None)  # the score bias is the keys' error

    def _of(self, kind: str):
        return self.keys if kind == "k" else self.values

    def fields(self, kind: str):
        return self._of(kind).fields(kind)

    def encode(self, x, kind: str):
        return self._of(kind).encode(x, kind)

    def decode(self, f, kind: str):
        return self._of(kind).decode(f, kind)

    def static_tensors(self) -> dict:
        return {f"k.{n}": t for n, t in self.keys.static_tensors().items()} | {
            f"v.{n}": t for n, t in self.values.static_tensors().items()}


class WorstTokensExact:
    """A tiered block codec that keeps, in every block, the `n` tokens its inner codec reconstructs worst
    (largest squared error over the head's channels) in fp16 beside the codes: a query-agnostic guess at
    the tokens a later query must read exactly (a needle's digits are unlike the text around them). The
    fp16 rows and their in-block positions are block fields, so the stored bits count them. The torch path
    only; measured by benchmarks/bench_retrieval.py (`RECIPE!N`)."""

    fused_decode_attention = False

    def __init__(self, inner, n: int, head_dim: int):
        self.inner, self.n, self.d = inner, n, head_dim
        self.name, self.bits, self.n_out = f"{inner.name}!{n}", inner.bits, 0
        self.rotation, self.k_err2 = getattr(inner, "rotation", None), getattr(inner, "k_err2", None)

    def fields(self, kind: str):
        return self.inner.fields(kind) | {"exact": ("block", (self.n, self.d), torch.float16),
                                          "exact_idx": ("block", (self.n,), torch.int16)}

    def encode(self, x, kind: str):
        f = self.inner.encode(x, kind)
        err = (self.inner.decode(f, kind) - x.float()).square().sum(-1)  # [M, K, N]
        idx = err.topk(self.n, dim=-1).indices  # [M, K, n]
        rows = x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))  # [M, K, n, d]
        return f | {"exact": rows.half()[:, :, None], "exact_idx": idx.short()[:, :, None]}

    def decode(self, f, kind: str):
        inner = {k: v for k, v in f.items() if k not in ("exact", "exact_idx")}
        y = self.inner.decode(inner, kind)  # [B, K, nb·N, d]
        B, K, nb, n = f["exact_idx"].shape
        N = y.shape[2] // max(nb, 1)
        pos = (f["exact_idx"].long() + N * torch.arange(nb, device=y.device)[:, None]).reshape(B, K, nb * n)
        return y.scatter(2, pos[..., None].expand(B, K, nb * n, y.shape[-1]),
                         f["exact"].float().reshape(B, K, nb * n, -1))

    def static_tensors(self) -> dict:
        return self.inner.static_tensors()
