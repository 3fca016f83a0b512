"""The per-expert Hessian observer against a direct computation."""

import torch
import torch.nn.functional as F

from moec.calibrate.hessian import ExpertHessians
from moec.runtime.config import ModelArgs


def test_expert_hessians_match_direct_sums():
    E, D, I, A = 4, 16, 12, 2
    args = ModelArgs(arch="mixtral", vocab_size=10, dim=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                     n_experts=E, top_k=A, expert_dim=I)
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g)
    got = {}
    obs = ExpertHessians(args, {0}, lambda i: {"layers.0.moe.w1": w1, "layers.0.moe.w3": w3},
                         lambda i, st: got.update({i: st}), all_tokens=True)
    xs, idss = [], []
    for _ in range(2):  # two batches accumulate
        x = torch.randn(2, 5, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(10)])
        ids[:, :] = torch.where(ids == 3, 0, ids)  # expert 3 gets no token
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % 3, ids[:, 1])
        obs(0, "ffn_in", x)
        obs(0, "expert_ids", ids)
        xs.append(x.reshape(-1, D))
        idss.append(ids)
    obs.flush()
    st = got[0]
    X, ids = torch.cat(xs), torch.cat(idss)
    for e in range(E):
        xe = X[(ids == e).any(-1)]
        ae = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
        assert st["count"][e] == xe.shape[0]
        torch.testing.assert_close(st["H1"][e], xe.T @ xe, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(st["H2"][e], ae.T @ ae, rtol=1e-5, atol=1e-4)
        a_all = F.silu(X @ w1[e].t()) * (X @ w3[e].t())
        torch.testing.assert_close(st["H2_all"][e], a_all.T @ a_all, rtol=1e-5, atol=1e-4)
    assert st["count"][3] == 0 and torch.count_nonzero(st["H1"][3]) == 0
    torch.testing.assert_close(st["H1_all"], X.T @ X, rtol=1e-5, atol=1e-4)


def test_attention_hessians_match_projection_inputs():
    """'attn_in' / 'attn_out' sums equal XᵀX of what wq (and wk, wv) and wo actually read; a later
    layer's event hands the finished layer over."""
    from moec.calibrate.hessian import AttentionHessians
    from moec.runtime.model import Block, rope_cos_sin

    args = ModelArgs(arch="mixtral", vocab_size=10, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6,
                     n_experts=2, top_k=1, expert_dim=8)
    torch.manual_seed(0)
    block = Block(args, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seen = {"wq": [], "wk": [], "wo": []}
    for name in seen:
        getattr(block.attn, name).register_forward_pre_hook(
            lambda _m, a, name=name: seen[name].append(a[0].reshape(-1, a[0].shape[-1])))
    got = {}
    obs = AttentionHessians(args, {0, 1}, lambda i, st: got.update({i: st}))
    cos, sin = rope_cos_sin(args, torch.arange(7), torch.float32)
    with torch.no_grad():
        for _ in range(2):  # two batches accumulate
            block(torch.randn(3, 7, 16), cos, sin, observer=obs)
    assert not got
    obs(1, "attn_in", torch.zeros(1, 1, 16))  # layer 1 starts: layer 0 is complete
    st = got[0]
    X, A = torch.cat(seen["wq"]), torch.cat(seen["wo"])
    assert st["count"] == 42 and A.shape[1] == 4 * 6
    torch.testing.assert_close(torch.cat(seen["wk"]), X)  # wq, wk, wv read one input: one Hessian
    torch.testing.assert_close(st["Hqkv"], X.T @ X, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(st["Ho"], A.T @ A, rtol=1e-5, atol=1e-4)
    obs.flush()
    assert got[1]["count"] == 1


def test_shared_hessians_match_direct_sums():
    """SharedHessians: Hx = Σ xxᵀ over every token (router and shared w1/w3), Hs = Σ aaᵀ with a the shared
    w2's input, only for the layers asked for, handed over once per layer (at the next layer or flush)."""
    from moec.calibrate.hessian import SharedHessians

    D, S = 16, 12
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)
    state = {f"layers.{i}.moe.shared.w{c}.weight": w for i in (0, 1) for c, w in ((1, w1), (3, w3))}
    got = {}
    obs = SharedHessians({0, 1}, {0}, lambda i: state, lambda i, st: got.update({i: st}))
    xs = [torch.randn(2, 5, D, generator=g) for _ in range(3)]
    obs(0, "ffn_in", xs[0])
    obs(0, "attn_in", torch.randn(2, 5, D, generator=g))  # not its event
    obs(0, "ffn_in", xs[1])
    obs(1, "ffn_in", xs[2])  # layer 0 complete
    assert set(got) == {0}
    obs.flush()
    x0 = torch.cat([xs[0], xs[1]]).reshape(-1, D)
    a0 = F.silu(x0 @ w1.t()) * (x0 @ w3.t())
    torch.testing.assert_close(got[0]["Hx"], x0.t() @ x0, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[0]["Hs"], a0.t() @ a0, rtol=1e-5, atol=1e-4)
    assert got[0]["count"] == 20 and got[1]["count"] == 10 and "Hs" not in got[1]  # layer 1: no shared w2 asked
    x2 = xs[2].reshape(-1, D)
    torch.testing.assert_close(got[1]["Hx"], x2.t() @ x2, rtol=1e-5, atol=1e-4)
