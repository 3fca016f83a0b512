"""The default decode path of every KV codec that has a kernel, on the CPU (issue 13).

A one-word slip once made the static engine crash on its first decode step whenever its cache was built
with default arguments, and no test saw it: every test passed `use_kernel=` explicitly and the CPU never
takes the kernel path by default. Here MOEC_KERNELS=1 makes the default the kernel path (Triton's
interpreter runs the kernels, TRITON_INTERPRET=1 as in CI), the caches are built exactly as
`moec generate` / `eval` build them (decode.make_cache, loader.kv_cache_factory, no path arguments),
and their logits are compared with the torch reference (MOEC_KERNELS=0) on a random model.

Tolerance: both paths run in fp32 and encode the same blocks into the same codes (the quantize-pack
kernel writes the codec's exact fields), so they differ by summation order only, ~1e-6 relative; a
wrong slot, position, rotation or block moves the logits by far more than 1e-3 (the bound).
"""

import os

import pytest
import torch

from moec.calibrate.pack_kv import kv_manifest, kv_view
from moec.calibrate.recipe import load_recipe
from moec.errors import UserError
from moec.runtime.backend import kernels_enabled, kernels_forced
from moec.runtime.config import ModelArgs
from moec.runtime.latency import random_kv_tensors, random_model
from moec.runtime.pathcheck import compare_paths

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernels run on the CPU only under TRITON_INTERPRET=1")

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "moec", "recipes")
# dense MLPs: the experts' kernels are not what this file checks (tests/kernels does), and under the
# interpreter they would triple its time
ARGS = ModelArgs(arch="llama", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                 max_seq_len=512, dense_dim=32)
# (recipe, kernel expected by default) for every KV codec family. Window 32, block 16, 4 sinks: the 83-token
# prompt leaves 2 history blocks and 47 window tokens, so the first of the 5 decode steps encodes a third
# block (through the quantize-pack kernel where there is one) and the later ones read it.
CASES = [("ablations/kv-nuq2-outlier", True), ("ablations/kv-nuq2-outlier-post", True), ("kv-nuq2-rot", True),
         ("kv-kivi2", False), ("ablations/kv-latent-head", True), ("ablations/kv-latent-head-post", True),
         ("kv-latent-layer-g2", True), ("kv-rvq-tiered", True)]
TOL = 1e-3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(ARGS, lambda name: None, "cpu", dtype=torch.float32)


def _section(recipe: str) -> tuple[dict, dict]:
    r = load_recipe(os.path.join(RECIPES, f"{recipe}.yaml"))
    kv = kv_view(r, kv_manifest(r, ARGS))
    kv |= {"window": 32, "sinks": 4, "block": 16}
    if "rvq" in kv:
        kv["rvq"] = kv["rvq"] | {"archive_after": 64}  # the archive tier too (must exceed window + block)
    return kv, random_kv_tensors(ARGS, kv)


@pytest.mark.parametrize("recipe,kernel", CASES)
def test_default_path_matches_torch_reference(model, recipe, kernel):
    section, tensors = _section(recipe)
    ids = torch.randint(0, ARGS.vocab_size, (88,), generator=torch.Generator().manual_seed(1))
    with kernels_forced("1"):
        res = compare_paths(model, section, tensors, ids, n_prompt=83)
    assert set(res) == {"static", "dynamic"}, res  # every KV codec runs in the static engine
    for engine, r in res.items():
        # the latent and RVQ static caches attend through their dequantized mirror (no kernel wired there)
        want = kernel and (engine == "dynamic" or section["codec"] == "nuq-outlier")
        assert r["kernel"] == want, (engine, r)
        assert r["steps"] == 6
        assert r["rel_l2_err"] < TOL, (engine, r)


@pytest.mark.parametrize("recipe", [c for c, _ in CASES])
def test_static_engine_matches_dynamic_cache(model, recipe):
    """The static CUDA-graph engine's cache (decode.static_cache_factory: the tiered, latent and RVQ caches in
    static mode) against the dynamic cache `moec eval` builds, on the torch path: the same tier rule
    and the same encoded blocks. Not bit-equal: the static engine's prefill attends over the unrounded K/V
    and the dynamic cache's over their fp16 copies, so later layers' K/V (and 2-bit codes near a boundary)
    differ slightly: 0.1–1.1% relative L2 on this model for every codec, nuq and kivi included, against
    35–70% between either and an fp16 cache. A codec ignored, a block misplaced or a rotation missed moves
    the logits by tens of percent; the bound is 3%."""
    from moec.runtime.pathcheck import _dynamic_logits, _static_logits

    section, tensors = _section(recipe)
    ids = torch.randint(0, ARGS.vocab_size, (100,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), kernels_forced("0"):
        static, _, _ = _static_logits(model, section, tensors, ids, 83, graphs=False)
        dynamic, _, _ = _dynamic_logits(model, section, tensors, ids, 83)
    rel = float((static[1:] - dynamic[1:]).norm() / dynamic[1:].norm())
    assert rel < 0.03, (recipe, rel)


def test_switch():
    with kernels_forced("0"):
        assert not kernels_enabled("cpu") and not kernels_enabled("cuda")
    with kernels_forced("1"):
        assert kernels_enabled("cpu")
    with kernels_forced("auto"):
        assert not kernels_enabled("cpu") and kernels_enabled("cuda")


def test_switch_bad_values(monkeypatch):
    """A bad value is a usage error (the CLI's one line and exit 2), not an internal one."""
    monkeypatch.setenv("MOEC_KERNELS", "fast")
    with pytest.raises(UserError, match="expected auto, tl, gluon, 1 or 0"):
        kernels_enabled("cpu")
    monkeypatch.setenv("MOEC_KERNELS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        kernels_enabled("cpu")


# DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, the correction bias, group top-2 (kernels/route_topk.py
# route_sigmoid_topk)
SIGMOID_GROUPS = dict(n_experts=8, router_score="sigmoid", topk_method="group_top2", n_group=4, topk_group=2,
                      router_bias=True, routed_scale=2.0)


@pytest.mark.parametrize("recipe,routing", [(None, {}), ("experts-hls2", {}), ("experts-hls2", SIGMOID_GROUPS)])
def test_graph_safe_moe_routes_through_the_kernel(recipe, routing, monkeypatch):
    """decode.graph_safe_moe (the static engine's MoE step: routing kernel + fused expert kernels) for dense
    experts (the fused kernels' dense mode) and 2-bit HLS experts, softmax or sigmoid group routing: against the
    same expert kernels routed by torch's route (equal up to fp32 rounding: a wrong id or weight moves the output
    by O(1)), and against MoE.forward on the torch path (the expert kernels' own rounding: fp16 products, ~3e-3
    here)."""
    from moec.kernels import route_topk
    from moec.runtime import decode

    args = ModelArgs(**{"arch": "mixtral", "vocab_size": 64, "dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
                        "head_dim": 16, "max_seq_len": 64, "n_experts": 4, "top_k": 2, "expert_dim": 32,
                        "ffn_kinds": ["moe"]} | routing)
    calls = []
    sigmoid_kernel = route_topk.route_sigmoid_topk
    monkeypatch.setattr(route_topk, "route_sigmoid_topk", lambda *a: calls.append(1) or sigmoid_kernel(*a))
    rule_for = (lambda name: None) if recipe is None else \
        load_recipe(os.path.join(RECIPES, f"{recipe}.yaml")).rule_for
    m = random_model(args, rule_for, "cpu", dtype=torch.float32, seed=3)
    moe = m.layers[0].moe
    x = torch.randn(3, args.dim, generator=torch.Generator().manual_seed(2))
    if routing:  # a correction bias that moves the choice (the model starts it at zero)
        moe.score_bias.data = torch.randn(args.n_experts, generator=torch.Generator().manual_seed(4)) * 0.3
    with torch.no_grad(), kernels_forced("0"):
        torch_path = moe(x, 0)
    with torch.no_grad(), kernels_forced("1"):
        got = decode.graph_safe_moe(moe, x, 0)
        monkeypatch.setattr(decode, "_ROUTE_FAILED", ["torch routing for the reference"])
        torch_routed = decode.graph_safe_moe(moe, x, 0)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(got, torch_routed) < 1e-5
    assert rel(got, torch_path) < 1e-2
    assert len(calls) == (1 if routing else 0)  # the sigmoid routing kernel ran (not torch's route) where it applies
