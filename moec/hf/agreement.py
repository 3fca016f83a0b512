"""The transformers path against moec's engine on an architecture both run (llama, mixtral, qwen2_moe, qwen3_moe,
olmoe): the comparisons tests/hf/test_generic_engine.py and benchmarks/bench_generic_engine.py make.

  - `engine_hessians`: the engine's per-expert (a dense MLP: one expert) Hessians on calibrate's own token
    sample, to set against a transformers-path CALIB_DIR written with keep_hessians (`hessian_rel`);
  - `packed_diff`: every quantized part of a layout-"hf" pack against the engine pack's, byte for byte, through
    the name map of moec/hf/load.py (experts' gate_up = the engine's w1 rows then w3 rows, a dense MLP's
    gate/up/down = w1/w3/w2 of its one expert, q/k/v/o = wq/wk/wv/wo, the router, the LM head);
  - `kv_rel`: the KV codec's calibrated tensors of the two CALIB_DIRs;
  - `ppl`: a pack's perplexity through the runner each path loads it with (its KV cache in `dec` mode).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..formats import checkpoint
from ..formats.codecs import ROTATION_PART

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)\.(\w+)$")
_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight\.(\w+)$")
_LIN_NAMES = {"q_proj": "attn.wq.weight", "k_proj": "attn.wk.weight", "v_proj": "attn.wv.weight",
              "o_proj": "attn.wo.weight", "gate": "moe.router.weight", "gate_proj": "moe.w1", "up_proj": "moe.w3",
              "down_proj": "moe.w2"}


def sample_tokens(model_dir: Path, data: str, split: str, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """tokens [samples, seq_len]: the sample `moec calibrate` (either path) draws with these arguments."""
    from ..calibrate.data import load_text
    from ..calibrate.dataspec import parse_data, sample_mix
    from ..calibrate.sources import load_tokenizer, tokenize

    specs = parse_data(data, split)
    torch.manual_seed(seed)
    tok = load_tokenizer(model_dir)
    ids = [tokenize(tok, load_text(s.name, s.split, s.config, s.column, tok)) for s in specs]
    return sample_mix(ids, specs, samples, seq_len, seed)[0]


def engine_hessians(model_dir: Path, tokens: torch.Tensor, layers: set[int] | None = None) -> dict[int, dict]:
    """{layer: {"H1": [E, D, D], "H2": [E, I, I], "count": [E]}}: calibrate/hessian.ExpertHessians over moec's
    engine (runtime/model.py) on tokens [N, L] (E = 1 for a dense MLP)."""
    from ..calibrate.capture import run_layers
    from ..calibrate.hessian import ExpertHessians
    from ..runtime.hf_layout import HFCheckpoint

    ckpt = HFCheckpoint(model_dir)
    layers = set(range(ckpt.args.n_layers)) if layers is None else layers
    out: dict[int, dict] = {}
    hs = ExpertHessians(ckpt.args, layers, ckpt.layer_state,
                        lambda i, s: out.__setitem__(i, {k: v.clone() for k, v in s.items() if k != "experts"}),
                        all_tokens=False)
    run_layers(ckpt.args, ckpt.global_state(), ckpt.layer_state, tokens, [hs])
    hs.flush()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def hessian_rel(calib_dir: Path, engine: dict[int, dict]) -> dict[str, float]:
    """{transformers matrix: ‖H_generic − H_engine‖ / ‖H_engine‖} for every layer of `engine` (engine_hessians),
    from CALIB_DIR/calib.safetensors's `hessian.<param>` (calibrate_generic with keep_hessians): an experts
    module's gate_up / down stacks, or a dense MLP's gate_proj, up_proj (both H1) and down_proj (H2)."""
    got = load_file(str(Path(calib_dir) / "calib.safetensors"))
    out = {}
    for i, w in engine.items():
        p = f"hessian.model.layers.{i}.mlp."
        pairs = [("experts.gate_up_proj", "H1"), ("experts.down_proj", "H2")] if p + "experts.down_proj" in got \
            else [("gate_proj.weight", "H1"), ("up_proj.weight", "H1"), ("down_proj.weight", "H2")]
        for name, key in pairs:
            if p + name not in got:
                continue
            g, e = got[p + name], w[key]
            out[f"model.layers.{i}.mlp.{name}"] = _rel(g, e if g.dim() == e.dim() else e[0])
    return out


def _engine_part(name: str, engine: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The engine pack's counterpart of layout-"hf" stored tensor `name` (None: no counterpart)."""
    if name.startswith("lm_head.weight."):
        return engine.get("output.weight." + name.removeprefix("lm_head.weight."))
    if m := _EXPERTS.match(name):
        i, stack, part = m.groups()
        if stack == "down_proj":
            return engine.get(f"layers.{i}.moe.w2.{part}")
        w1, w3 = engine.get(f"layers.{i}.moe.w1.{part}"), engine.get(f"layers.{i}.moe.w3.{part}")
        if w1 is None or w3 is None:
            return None
        return w1 if part == ROTATION_PART else torch.cat([w1, w3], dim=1)  # gate rows, then up rows
    if m := _LINEAR.match(name):
        i, _, mod, part = m.groups()
        canon = _LIN_NAMES.get(mod)
        t = None if canon is None else engine.get(f"layers.{i}.{canon}.{part}")
        if t is not None and canon.startswith("moe.w") and part != ROTATION_PART:
            t = t[0]  # a dense MLP: the engine's one expert
        return t
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def packed_diff(engine_pack: Path, generic_pack: Path) -> dict:
    """{"compared": quantized parts compared, "identical": those equal bit for bit, "different": their names,
    "unmatched": parts without an engine counterpart}, over every quantized part of the layout-"hf" pack."""
    em, gm = checkpoint.verify(engine_pack), checkpoint.verify(generic_pack)
    e = checkpoint.load_tensors(engine_pack, em)
    g = checkpoint.load_tensors(generic_pack, gm)
    from ..registry import stored_as_is

    out = {"compared": 0, "identical": 0, "different": [], "unmatched": []}
    for n, info in gm["tensors"].items():
        if stored_as_is(info["codec"]) or n.startswith("kv."):
            continue
        t = _engine_part(n, e)
        if t is None:
            out["unmatched"].append(n)
            continue
        out["compared"] += 1
        if t.shape == g[n].shape and t.dtype == g[n].dtype and torch.equal(_bytes(t), _bytes(g[n])):
            out["identical"] += 1
        else:
            out["different"].append(n)
    return out


def kv_rel(engine_calib: Path, generic_calib: Path) -> dict[str, float]:
    """{kv tensor: relative difference} of the two CALIB_DIRs' KV codec tensors (`kv.*`); KeyError when their
    names differ."""
    e, g = (load_file(str(Path(d) / "calib.safetensors")) for d in (engine_calib, generic_calib))
    names = sorted(n for n in e if n.startswith("kv."))
    if names != sorted(n for n in g if n.startswith("kv.")):
        raise KeyError(f"KV tensors differ: engine {names}, transformers {sorted(n for n in g if n.startswith('kv.'))}")
    return {n: _rel(g[n].float(), e[n].float()) for n in names}


def ppl(pack: Path, windows: torch.Tensor, mode: str = "tf") -> dict:
    """runtime/perplexity.evaluate of packed checkpoint `pack` on windows [n, W] through the path it was packed
    for (layout "hf": hf/runner.load_runner, else runtime/loader.load_model), with its KV cache in `dec` mode."""
    from ..runtime.perplexity import evaluate, fp16_cache

    if checkpoint.read_manifest(pack).get("layout") == "hf":
        from .runner import load_runner

        model, _ = load_runner(pack)
        factory = model.cache_factory
    else:
        from ..runtime.loader import kv_cache_factory, load_model

        model, info = load_model(pack)
        factory = kv_cache_factory(info, model.args) or fp16_cache
    return evaluate(model, windows, mode, cache_factory=factory)
