"""Per-expert second-moment statistics H = XᵀX (GPTQ, SqueezeLLM) and their regularization.

Pure functions first (`accumulate_hessian`, `regularize`), then the capture observer
`ExpertHessians`, which turns the model's 'ffn_in' / 'expert_ids' events into, per MoE or dense
layer and per expert e:
    H1[e] = Σ x xᵀ over tokens routed to e     [D, D]  (input of gate w1 and up w3)
    H2[e] = Σ a aᵀ, a = silu(w1_e x) ⊙ (w3_e x)  [I, I]  (input of down w2)
    count[e]                                     tokens routed to e
all in fp32, accumulated in place. Under `all-experts-for-stats` it also accumulates the same sums
over every calibration token (outputs of the layer still use the true routing: the observer only
reads activations), which replace the routed sums of experts that got fewer than `min_expert_tokens`
tokens. Statistics use the original weights layer by layer (capture.py); quantized outputs are not
propagated to later layers.

`AttentionHessians` does the same for the attention projections from the 'attn_in' / 'attn_out'
events: per layer Hqkv = Σ x xᵀ over the normed hidden states entering attention [D, D] (one H
shared by wq, wk and wv, which read the same input) and Ho = Σ a aᵀ over the attention outputs
entering wo [H·d, H·d]; every token passes through attention, so there is no routing or policy.
`SharedHessians` likewise for the router and the shared expert (every token takes it) from 'ffn_in'.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..runtime.config import ModelArgs
from ..runtime.model import expert_act


def accumulate_hessian(H: torch.Tensor, x: torch.Tensor) -> None:
    """H [D, D] fp32 += xᵀx for x [N, D] (in place)."""
    H.addmm_(x.t().float(), x.float())


def regularize(H: torch.Tensor, damp: float = 0.01, max_tries: int = 6) -> tuple[torch.Tensor, dict]:
    """A positive definite copy of H [D, D] and a note of what was done to get it.

    Non-finite entries or an all-zero H fall back to the identity (plain least squares). Otherwise
    damp·mean(diag)·I is added (GPTQ's dampening) and multiplied by 10 until Cholesky succeeds.
    """
    D = H.shape[0]
    eye = torch.eye(D, dtype=torch.float32, device=H.device)
    H = H.float()
    if not torch.isfinite(H).all():
        return eye, {"status": "non-finite", "damp": None}
    mean_diag = H.diagonal().mean().item()
    if mean_diag <= 0:  # all zero (no signal), or a negative trace no damping scaled by it can repair
        return eye, {"status": "zero" if torch.count_nonzero(H) == 0 else "singular", "damp": None}
    lam = damp
    for _ in range(max_tries):
        Hd = H + lam * mean_diag * eye
        if torch.linalg.cholesky_ex(Hd)[1].item() == 0:
            return Hd, {"status": "ok" if lam == damp else "extra-damped", "damp": lam}
        lam *= 10
    return eye, {"status": "singular", "damp": None}


class ExpertHessians:
    """Capture observer accumulating H1, H2 and token counts per expert for the `layers` asked for.

    `layer_state(i)` returns the canonical tensors of layer i (for the w1/w3 weights that produce
    the down projection's inputs); `on_layer(i, stats)` is called when layer i is complete, so the
    caller can fit and drop the statistics (memory stays at one layer's Hessians).

    `experts`: the experts this process accumulates (distributed.Dist.owned; None: all of them). H1, H2
    and H2_all hold only those, in that order (stats["experts"]), so each rank of an expert-parallel run
    holds 1/world of the Hessians; an expert's sums see the same tokens in the same order as in one
    process. Token counts are kept for every expert (the report needs them; they cost nothing).
    """

    def __init__(self, args: ModelArgs, layers: set[int], layer_state: Callable[[int], dict],
                 on_layer: Callable[[int, dict], None], all_tokens: bool, experts: list[int] | None = None):
        self.args, self.layers, self.layer_state, self.on_layer = args, layers, layer_state, on_layer
        self.all_tokens, self.experts = all_tokens, experts
        self.cur: int | None = None
        self.stats: dict = {}
        self.x: torch.Tensor | None = None

    def _start(self, layer: int, device: torch.device) -> None:
        if self.cur is not None and self.cur != layer:
            self.flush()
        if self.cur == layer:
            return
        self.cur = layer
        sd = self.layer_state(layer)
        # statistics live on the device the activations come from (the GPU under --device cuda)
        self.w1 = sd[f"layers.{layer}.moe.w1"].to(device, torch.float32)  # [E, I, D]
        self.w3 = sd[f"layers.{layer}.moe.w3"].to(device, torch.float32)
        b = f"layers.{layer}.moe.b"  # gpt-oss's expert biases (their act's input; b2 does not reach H2)
        self.b13 = (sd[b + "1"].to(device, torch.float32), sd[b + "3"].to(device, torch.float32)) \
            if b + "1" in sd else None
        E, I, D = self.w1.shape
        # dense layers have one expert (0), owned by rank 0
        mine = [e for e in (range(E) if self.experts is None else self.experts) if e < E]
        self.local = {e: j for j, e in enumerate(mine)}  # expert -> index into H1/H2/H2_all
        n, z = len(mine), dict(dtype=torch.float32, device=device)
        self.stats = {"H1": torch.zeros(n, D, D, **z), "H2": torch.zeros(n, I, I, **z),
                      "count": torch.zeros(E, dtype=torch.long), "experts": mine}
        if self.all_tokens:
            self.stats.update(H1_all=torch.zeros(D, D, **z), H2_all=torch.zeros(n, I, I, **z), n_all=0)

    def _act(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input [n, I]: the model's gated activation of the (biased) gate and up."""
        g, u = x @ self.w1[e].t(), x @ self.w3[e].t()
        if self.b13 is not None:
            g, u = g + self.b13[0][e], u + self.b13[1][e]
        return expert_act(g, u, self.args)

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if layer not in self.layers or name not in ("ffn_in", "expert_ids"):
            return
        self._start(layer, t.device)
        s = self.stats
        if name == "ffn_in":
            self.x = t.detach().reshape(-1, t.shape[-1]).float()  # [N, D]
            if self.args.ffn_kinds[layer] == "dense":  # every token takes the single expert
                self._add(0, self.x)
            elif self.all_tokens:
                accumulate_hessian(s["H1_all"], self.x)
                s["n_all"] += self.x.shape[0]
                for e, j in self.local.items():
                    accumulate_hessian(s["H2_all"][j], self._act(e, self.x))
            return
        ids = t.detach().to(self.x.device) if self.x is not None else t.detach()  # [N, A]
        assert self.x is not None and ids.shape[0] == self.x.shape[0], (ids.shape, None if self.x is None
                                                                        else self.x.shape)
        for e in ids.unique().tolist():
            tok = (ids == e).any(-1).nonzero().squeeze(-1)
            self._add(e, self.x[tok])
        self.x = None

    def _add(self, e: int, x: torch.Tensor) -> None:
        s = self.stats
        s["count"][e] += x.shape[0]  # count stays on the CPU (the report reads it)
        if (j := self.local.get(e)) is not None:
            accumulate_hessian(s["H1"][j], x)
            accumulate_hessian(s["H2"][j], self._act(e, x))

    def flush(self) -> None:
        if self.cur is not None:
            layer, stats = self.cur, self.stats
            # the fp32 w1/w3 copies are not needed by the fit: free them before it (3.8 GB at the Mixtral shape)
            self.cur, self.stats, self.x, self.w1, self.w3 = None, {}, None, None, None
            self.on_layer(layer, stats)


class AttentionHessians:
    """Capture observer accumulating Hqkv [D, D] (input of wq/wk/wv; MLA: wq or wq_a, wkv_a), Ho [H·d, H·d]
    (input of wo) and
    the token count for the attention of the `layers` asked for; like ExpertHessians, `on_layer(i,
    stats)` is called once layer i is complete (at the first event of a later layer, or `flush()`),
    so only one layer's statistics are held."""

    def __init__(self, args: ModelArgs, layers: set[int], on_layer: Callable[[int, dict], None]):
        self.args, self.layers, self.on_layer = args, layers, on_layer
        self.cur: int | None = None
        self.stats: dict = {}

    # MLA (runtime/model.MLAttention) adds Hqb [q_lora, q_lora] (input of wq_b, 'q_lat') and Hkvb [r, r]
    # (input of wkv_b: the latent c, the first r channels of 'kv_latent')
    EVENTS = {"attn_in": "Hqkv", "attn_out": "Ho", "q_lat": "Hqb", "kv_latent": "Hkvb"}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if layer not in self.layers or name not in self.EVENTS:
            return
        a = self.args
        if self.cur != layer:
            self.flush()
            self.cur = layer
            dims = {"Hqkv": a.dim, "Ho": a.n_heads * (a.v_head_dim if a.is_mla else a.head_dim)}
            if a.is_mla:
                dims["Hkvb"] = a.kv_lora_rank
                if a.q_lora_rank:
                    dims["Hqb"] = a.q_lora_rank
            z = dict(dtype=torch.float32, device=t.device)  # where the activations are (cpu or cuda)
            self.stats = {k: torch.zeros(n, n, **z) for k, n in dims.items()} | {"count": 0}
        if name == "kv_latent":
            t = t[..., : a.kv_lora_rank]
        x = t.detach().reshape(-1, t.shape[-1])  # [N, D], [N, H·d], ...
        accumulate_hessian(self.stats[self.EVENTS[name]], x)
        if name == "attn_in":
            self.stats["count"] += x.shape[0]

    def flush(self) -> None:
        if self.cur is not None:
            layer, stats = self.cur, self.stats
            self.cur, self.stats = None, {}
            self.on_layer(layer, stats)


class SharedHessians:
    """Capture observer for the router and the shared expert of the `layers` asked for, from 'ffn_in':
    Hx = Σ x xᵀ [D, D] over every token's normed x (the router and the shared w1/w3 read it; every token
    takes the shared expert, so there is no routing or policy) and, for the layers in `down` (a targeted
    shared w2), Hs = Σ a aᵀ [S, S] with a = silu(w1_s x) ⊙ (w3_s x) the shared w2's input, from the
    original shared weights (`layer_state`). Like AttentionHessians, `on_layer(i, stats)` is called once
    layer i is complete, so only one layer's statistics are held."""

    def __init__(self, layers: set[int], down: set[int], layer_state: Callable[[int], dict],
                 on_layer: Callable[[int, dict], None]):
        self.layers, self.down, self.layer_state, self.on_layer = layers, down, layer_state, on_layer
        self.cur: int | None = None
        self.stats: dict = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if layer not in self.layers or name != "ffn_in":
            return
        x = t.detach().reshape(-1, t.shape[-1]).float()  # [N, D]
        if self.cur != layer:
            self.flush()
            self.cur = layer
            z = dict(dtype=torch.float32, device=x.device)  # where the activations are (cpu or cuda)
            self.stats = {"Hx": torch.zeros(x.shape[1], x.shape[1], **z), "count": 0}
            self.w13 = None
            if layer in self.down:
                sd = self.layer_state(layer)
                p = f"layers.{layer}.moe.shared."
                self.w13 = tuple(sd[p + f"{w}.weight"].to(x.device, torch.float32) for w in ("w1", "w3"))
                S = self.w13[0].shape[0]
                self.stats["Hs"] = torch.zeros(S, S, **z)
        accumulate_hessian(self.stats["Hx"], x)
        self.stats["count"] += x.shape[0]
        if self.w13 is not None:
            accumulate_hessian(self.stats["Hs"], F.silu(x @ self.w13[0].t()) * (x @ self.w13[1].t()))

    def flush(self) -> None:
        if self.cur is not None:
            layer, stats = self.cur, self.stats
            self.cur, self.stats, self.w13 = None, {}, None
            self.on_layer(layer, stats)
