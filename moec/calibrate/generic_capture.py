"""`moec calibrate` on the transformers path: layer-sequential capture through transformers' own modeling code,
for MoE types moec's engine does not implement (and, with `--path transformers`, for those it does).

Shape legend: B = batch, L = tokens per sequence, N = tokens, E = experts, D = model dim, O = outputs, I = inputs.

Like capture.py, one decoder layer's weights are held at a time (moec/hf/stream.SourceModel: the model built on
the meta device, a layer materialised from the shards through transformers' checkpoint conversions). Layer i
runs inside the model's own forward (run_layer): the layers before it stand in by returning what layer i - 1
returned (a tensor, or a tuple such as (hidden_states, topk_indices) that some models pass from layer to layer),
the forward stops once layer i has returned, so layer i gets exactly the arguments the model gives it (position
embeddings, the mask of its layer type, ...) without a per-architecture table (GPTQModel / llm-compressor
"sequential onloading", with the embedding and masks recomputed per layer instead of stored).

Statistics, per targeted matrix (what the fitting functions of fit_experts.ExpertFitter take):
  - expert stacks: the experts implementation "moec_capture" (registered here), selected on the experts modules
    of the layer being captured, computes the original output and accumulates, per expert e,
    H_in[e] = Σ x xᵀ over the tokens routed to e (input of gate_up / up), H_mid[e] = Σ h hᵀ over the
    module's own gate output (input of down; gpt_oss's clamped SwiGLU included), the token counts, and under
    `all-experts-for-stats` the same sums over every token;
  - nn.Linear weights (attention projections, dense and shared MLPs, the LM head) and routers: a forward
    pre-hook accumulating H = Σ x xᵀ of the module's input.
The fits run once a layer's batches are done, and the layer's weights and statistics are dropped.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .. import __version__
from ..atomic import atomic_dir
from ..errors import UserError
from ..hf.generic import (
    apply_gate,
    attention_modules,
    dispatch_experts,
    experts_modules,
    param_groups,
    rows,
    stack_params,
)
from ..hf.stream import SourceModel, trim_heap
from ..provenance import created_timestamp, environment
from ..registry import kv_codec
from ..rotation import hadamard_signs
from .fit_experts import HEAD, ExpertFitter, rotation_signs
from .generic_pack import bind_kv, plan_generic
from .hessian import accumulate_hessian, regularize
from .recipe import Recipe

CAPTURE_IMPL = "moec_capture"
PATH = "transformers"  # report.json `path` of a calibration made here
FIT_FILE_PREFIX = "fit-layer-"  # CALIB_DIR/fit-layer-0000i.safetensors: layer i's fitted parts (fit.<param>.<part>)


class ExpertStats:
    """Per-expert statistics of one experts module for one layer (see the module docstring)."""

    def __init__(self, n_experts: int, d_in: int, d_mid: int, all_tokens: bool, device):
        z = dict(dtype=torch.float32, device=device)
        self.H_in = torch.zeros(n_experts, d_in, d_in, **z)
        self.H_mid = torch.zeros(n_experts, d_mid, d_mid, **z)
        self.count = torch.zeros(n_experts, dtype=torch.long)
        self.all_tokens = all_tokens
        if all_tokens:
            self.H_in_all = torch.zeros(d_in, d_in, **z)
            self.H_mid_all = torch.zeros(n_experts, d_mid, d_mid, **z)
        self.top_k = 0


def _dense(mod: nn.Module, name: str, e: int, dtype) -> torch.Tensor:
    w = getattr(mod, name)[e]
    return (w.t() if mod.is_transposed else w).to(dtype)


def _mid(mod: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's down-projection input for x [n, D] (bias, gate and activation as the module has them)."""
    up = stack_params(mod)[0]
    h = x @ _dense(mod, up, e, x.dtype).t()
    if mod.has_bias:
        h = h + getattr(mod, up + "_bias")[e].to(x.dtype)
    return apply_gate(mod, h) if mod.has_gate else mod.act_fn(h)


def capture_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts implementation "moec_capture": the module's output (x [N, D] -> [N, D], the reference loop
    with its own weights), the statistics of `self.moec_stats` (ExpertStats) accumulated on the way."""
    s: ExpertStats = self.moec_stats
    down = stack_params(self)[1]
    out = torch.zeros_like(hidden_states)
    x32 = hidden_states.float()
    s.top_k = top_k_index.shape[-1]
    if s.all_tokens:
        accumulate_hessian(s.H_in_all, x32)
        for e in range(self.num_experts):
            accumulate_hessian(s.H_mid_all[e], _mid(self, e, x32))
    for e in top_k_index.unique().tolist():
        if e < 0 or e >= self.num_experts:
            continue
        tok, pos = torch.where(top_k_index == e)
        x = hidden_states[tok]
        h = _mid(self, e, x)
        s.count[e] += tok.numel()
        accumulate_hessian(s.H_in[e], x.float())
        accumulate_hessian(s.H_mid[e], h.float())
        y = h @ _dense(self, down, e, h.dtype).t()
        if self.has_bias:
            y = y + self.down_proj_bias[e].to(y.dtype)
        out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def capture_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, **kwargs):
    """Attention implementation "moec_capture": transformers' SDPA attention, the post-RoPE query [B, H, T, d],
    keys and values [B, K, T, d] handed to `module.moec_observer(layer, name, tensor)` (a KV codec's sampler,
    as capture.py's observers see them) on the way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observe = getattr(module, "moec_observer", None)
    if observe is not None:
        for name, t in (("q", query), ("k", key), ("v", value)):
            observe(module.layer_idx, name, t)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(CAPTURE_IMPL, capture_experts_forward)
    ALL_ATTENTION_FUNCTIONS.register(CAPTURE_IMPL, capture_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_IMPL, sdpa_mask)


_register()


class _Stop(Exception):
    """Raised once the layer being captured has returned: the rest of the model's forward is not needed."""


class _Stand(nn.Module):
    """Stands in for a decoder layer j != i while the model's forward runs for layer i: before i, it returns
    layer i - 1's recorded output (what the model's loop passes on: a tensor, or a tuple such as
    (hidden_states, topk_indices)); after i, it stops the forward."""

    def __init__(self, layer: nn.Module, output=None, stop: bool = False):
        super().__init__()
        self.layer, self.output, self.stop = layer, output, stop

    def __getattr__(self, name):  # the model's loop may read the layer's attributes (attention_type, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        if self.stop:
            raise _Stop
        return self.output


class _Record(nn.Module):
    """Layer i itself, its output recorded (and the forward stopped after it)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer, self.output = layer, None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        self.output = self._modules["layer"](*args, **kwargs)
        raise _Stop


@torch.no_grad()
def run_layer(src: SourceModel, i: int, tokens: torch.Tensor, previous):
    """Decoder layer i's output for tokens [B, L], run inside the model's own forward (so its arguments, the
    mask of its layer type and anything an earlier layer passes on, are the model's), with layers before it
    returning `previous` (layer i - 1's recorded output; None for i = 0) and the forward stopped after it."""
    layers = src.layers
    originals = list(layers)
    rec = _Record(originals[i])
    for j, layer in enumerate(originals):
        layers[j] = rec if j == i else _Stand(layer, previous, stop=j > i)
    try:
        src.model.model(input_ids=tokens, use_cache=False)
    except _Stop:
        pass
    finally:
        for j, layer in enumerate(originals):
            layers[j] = layer
    assert rec.output is not None, f"layer {i} was not called by the model's forward"
    return rec.output


def hidden_of(output) -> torch.Tensor:
    """The hidden states in a decoder layer's output (a tensor, or a tuple led by them)."""
    return output[0] if isinstance(output, tuple) else output


class _LinearStats:
    """H = Σ x xᵀ of a module's input (forward pre-hook), for one layer."""

    def __init__(self):
        self.H: torch.Tensor | None = None
        self.count = 0

    def __call__(self, module, args, kwargs=None):
        x = args[0] if args else next(iter((kwargs or {}).values()))
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.H is None:
            self.H = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        accumulate_hessian(self.H, x)
        self.count += x.shape[0]


_DOWN = re.compile(r"(^|_)(down|fc2|w2|c_proj)(_|$)")  # a MLP's second matrix: reads the intermediate
_OUT = re.compile(r"^(o_proj|out_proj|dense|wo|o)$")  # an attention's output projection: reads the heads' output
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def engine_name(name: str, group: str) -> str | None:
    """The engine's canonical name (fit_experts) of the matrix reading the same input as transformers parameter
    `name` of target group `group`, or None (a matrix the engine has no counterpart of: MLA's latent projections
    read as attention, linear attention...). It seeds the incoherence rotation (fit_experts.rotation_signs), so
    both paths draw the same signs for the same (layer, input) and their packed bytes can be compared: experts'
    gate_up / up and a dense MLP's gate and up read layer i's x (`layers.i.moe.w1`), down its intermediate
    (`moe.w2`); q/k/v the attention input (`attn.wq`), o the heads' output (`attn.wo`); the router x; shared
    experts theirs; the LM head `output.weight`."""
    if name == "lm_head.weight":
        return HEAD
    m = _LAYER.search(name)
    if m is None:
        return None
    i = m.group(1)
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]  # the module (linear) or the stack (experts)
    down = _DOWN.search(leaf) is not None
    if group in ("experts", "mlp"):
        return f"layers.{i}.moe.{'w2' if down else 'w1'}"
    if group == "shared_experts":
        return f"layers.{i}.moe.shared.{'w2' if down else 'w1'}.weight"
    if group == "attention":
        return f"layers.{i}.attn.{'wo' if _OUT.match(leaf) else 'wq'}.weight"
    if group == "router":
        return f"layers.{i}.moe.router.weight"
    return None


class GenericFitter(ExpertFitter):
    """ExpertFitter's quantizers and starved-expert policy on transformers' parameter names: `fit.<param>.<part>`
    tensors, expert stacks [E, O, I] fitted one expert at a time, linear weights [O, I] as one matrix.
    `engine_names` ({param: engine_name}) seeds the incoherence rotations."""

    engine_names: dict[str, str | None] = {}

    def rotation_signs(self, name: str, n: int, rule) -> torch.Tensor | None:
        """The engine's rotation of the matrix reading the same input (engine_name); a matrix without a
        counterpart gets signs seeded by its own name (every matrix stores its signs: any seed is correct)."""
        if rule.incoherence is None:
            return None
        canon = self.engine_names.get(name)
        if canon is not None:
            return rotation_signs(canon, n, rule, self.seed)
        return hadamard_signs(n, rule.incoherence.block_for(n), (1 << 42) + self.seed * 100_003 +
                              zlib.crc32(name.encode()))

    def fit_stack(self, name: str, W: torch.Tensor, stats: dict, key: str) -> dict:
        """W [E, O, I] (rows = outputs) with the damped per-expert Hessians stats[key] (policy applied)."""
        experts = list(range(W.shape[0]))
        H, notes = self._hessians(stats, key, experts)
        tensors, entry = self._fit_widths(name, [W[e : e + 1].to(H.device, torch.float32) for e in experts],
                                          [H[e : e + 1] for e in experts], self.targets[name])
        self.tensors.update(tensors)
        entry["hessians"] = [{"tokens": n["tokens"], "hessian": n["hessian"], "status": n["status"]} for n in notes]
        return entry

    def fit_linear(self, name: str, W: torch.Tensor, H: torch.Tensor, count: int) -> dict:
        Hd, note = regularize(H)
        parts, entry = self._fit(name, W.to(Hd.device, torch.float32), Hd, self.targets[name])
        self.tensors.update({f"fit.{name}.{part}": t for part, t in parts.items()})
        return {"tokens": count, "status": note["status"], "damp": note["damp"], **entry}


def calibrate_generic(model_dir: Path, model_spec: str, recipe: Recipe, data: str, split: str, samples: int,
                      seq_len: int, seed: int, out_dir: Path, device: str = "cpu", progress=None,
                      data_config: str | None = None, text_column: str = "text", batch_size: int = 8,
                      keep_hessians: bool = False) -> dict:
    """The transformers-path `moec calibrate`: writes CALIB_DIR (fit-layer-0000i.safetensors with layer i's
    `fit.<param>.<part>`, written as each layer is done; calib.safetensors with the LM head's fit and per-layer
    expert token counts; report.json with `path: transformers`; recipe.yaml). keep_hessians:
    also store every captured (raw, undamped) Hessian as `hessian.<param>` (tests compare them)."""
    from .data import load_text
    from .dataspec import check_specs, describe, parse_data, sample_mix
    from .resume import refuse_without_resume
    from .run import load_balance
    from .sources import load_tokenizer, tokenize

    if samples < 1 or seq_len < 2:
        raise UserError(f"--samples must be >= 1 and --seq-len >= 2, got {samples} and {seq_len}")
    sources = parse_data(data, split, data_config, text_column)
    check_specs(sources, samples)
    data, split = describe(sources)
    src = SourceModel(model_dir, dtype=torch.float32, device=device)
    model = src.model
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise UserError(f"--seq-len {seq_len} is longer than the model supports ({max_pos} tokens)")
    targets = plan_generic(model, recipe)
    kv_model_args = bind_kv(model, recipe)  # None: no KV codec to calibrate
    refuse_without_resume(out_dir)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    ids = [tokenize(tokenizer, load_text(s.name, s.split, s.config, s.column, tokenizer)) for s in sources]
    tokens, source_records = sample_mix(ids, sources, samples, seq_len, seed)
    vocab = model.config.get_text_config().vocab_size
    if int(tokens.max()) >= vocab:
        raise UserError(f"the tokenizer of {model_spec} gives ids up to {int(tokens.max())}, beyond the model's "
                        f"vocabulary of {vocab}")
    cal = recipe.calibration
    fitter = GenericFitter(targets, lambda i: {}, cal.expert_policy, cal.min_expert_tokens, seed=seed)
    all_tokens = cal.expert_policy == "all-experts-for-stats" and cal.min_expert_tokens > 0
    groups = param_groups(model)
    fitter.engine_names = {n: engine_name(n, groups.get(n, "other")) for n in targets}
    with atomic_dir(out_dir, is_output=lambda p: (p / "report.json").is_file(), what="a calibration directory") \
            as tmp:
        t0 = time.time()
        src.load_globals()
        batches = [tokens[s : s + batch_size].to(device) for s in range(0, tokens.shape[0], batch_size)]
        outputs = [None] * len(batches)  # per batch: the last layer's output, what the next layer gets
        kv_spec = kv_codec(recipe.kv.codec) if kv_model_args is not None else None
        sampler = kv_spec.hook("sampler")(recipe.kv, seed) if kv_spec is not None and kv_spec.sampler else None
        if sampler is not None:  # post-RoPE q/k/v through the attention implementation "moec_capture"
            for mod in model.modules():
                cfg = getattr(mod, "config", None)
                if cfg is not None and hasattr(cfg, "_attn_implementation"):
                    cfg._attn_implementation = CAPTURE_IMPL
            for att in attention_modules(model).values():
                att.moec_observer = sampler
        hessians: dict[str, torch.Tensor] = {}
        stats_tensors: dict[str, torch.Tensor] = {}
        report_layers = []
        for i in range(src.n_layers):
            layer = src.load_layer(i)
            prefix = f"model.layers.{i}."
            entry: dict = {"layer": i}
            ex = {p: m for p, m in experts_modules(model).items() if p.startswith(prefix)}
            saved_cfg = {}
            for p, m in ex.items():
                up, down = stack_params(m)
                m.moec_stats = ExpertStats(m.num_experts, rows(m, getattr(m, up)).shape[-1],
                                           rows(m, getattr(m, down)).shape[-1],
                                           all_tokens and not getattr(m, "moec_plain", False), device)
                saved_cfg[p] = dispatch_experts(m, CAPTURE_IMPL)
            hooks, lin = [], {}
            for name in targets:
                mod_path = name.rpartition(".")[0]
                if not name.startswith(prefix) or mod_path in ex:
                    continue
                lin[name] = _LinearStats()
                hooks.append(model.get_submodule(mod_path).register_forward_pre_hook(lin[name]))
            for j, b in enumerate(batches):
                outputs[j] = run_layer(src, i, b, outputs[j])
            for hk in hooks:
                hk.remove()
            for p, m in ex.items():
                s = m.moec_stats
                del m.moec_stats
                saved_cfg[p]()  # the module's own implementation back
                counts = s.count
                top_k = s.top_k if not getattr(m, "moec_plain", False) else \
                    getattr(model.config.get_text_config(), "num_experts_per_tok", 1)  # rows came one expert each
                entry.setdefault("experts", load_balance(counts, top_k))
                stats_tensors[f"{p}.expert_tokens"] = counts
                up, down = stack_params(m)
                for pname, key in ((up, "H_in"), (down, "H_mid")):
                    full = f"{p}.{pname}"
                    if keep_hessians:
                        hessians[f"hessian.{full}"] = getattr(s, key).clone()
                    if full not in targets:
                        continue
                    st = {"H": getattr(s, key), "count": counts}
                    if all_tokens:
                        st["H_all"] = s.H_in_all if key == "H_in" else s.H_mid_all
                    W = rows(m, getattr(m, pname)).detach()
                    entry.setdefault("weights", {})[full] = fitter.fit_stack(full, W, st, "H")
            for name, st in lin.items():
                if keep_hessians:
                    hessians[f"hessian.{name}"] = st.H.clone()
                W = model.get_parameter(name).detach()
                entry.setdefault("weights", {})[name] = fitter.fit_linear(name, W, st.H, st.count)
            report_layers.append(entry)
            s = st = W = lin = None  # this layer's statistics and weights dropped before the next layer loads
            src.release(layer)
            if fitter.tensors:  # the layer's fitted parts to disk: memory holds one layer's, not the model's
                save_file({k: v.contiguous() for k, v in fitter.tensors.items()},
                          str(tmp / f"{FIT_FILE_PREFIX}{i:05d}.safetensors"), metadata={"format": "moec-calib"})
                fitter.tensors.clear()
                trim_heap()
            if progress is not None:
                progress(i + 1, src.n_layers)
        head = "lm_head.weight"
        if head in targets:
            H, n = None, 0
            norm = model.model.norm
            for out in outputs:
                h = hidden_of(out)
                x = norm(h).reshape(-1, h.shape[-1]).float()
                if H is None:
                    H = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
                accumulate_hessian(H, x)
                n += x.shape[0]
            if keep_hessians:
                hessians[f"hessian.{head}"] = H.clone()
            fitter.head_report = fitter.fit_linear(head, model.get_parameter(head).detach(), H, n)
        kv_tensors, kv_report = {}, None
        if kv_spec is not None and kv_spec.fit is not None:
            kv_tensors, kv_report = kv_spec.hook("fit")(kv_model_args, recipe.kv, sampler, device)
        seconds = time.time() - t0
        fp = src.fingerprint()
        report = {
            "moec_version": __version__, "created": created_timestamp(), "path": PATH,
            "model": model_spec, "model_path": str(model_dir), **fp, "model_type": model.config.model_type,
            "data": data, "split": split, "sources": source_records, "samples": samples, "seq_len": seq_len,
            "seed": seed, "tokens": int(tokens.numel()), "capture_seconds": round(seconds, 2), "device": device,
            "environment": environment(device), "recipe": recipe.name, "expert_policy": cal.expert_policy,
            "min_expert_tokens": cal.min_expert_tokens, "processes": 1, "propagate": "fp",
            "groups": sorted({groups.get(n, "other") for n in targets}), "layers": report_layers,
        }
        if fitter.head_report is not None:
            report["lm_head"] = fitter.head_report
        if kv_report is not None:
            report["kv"] = kv_report
        tensors = {k: v.contiguous() for k, v in fitter.tensors.items()} | stats_tensors | hessians | kv_tensors
        save_file(tensors, str(tmp / "calib.safetensors"), metadata={"format": "moec-calib"})
        (tmp / "report.json").write_text(json.dumps(report, indent=1))
        (tmp / "recipe.yaml").write_text(recipe.to_yaml())
    return report


def is_generic_calibration(calib_dir: Path) -> bool:
    """Whether CALIB_DIR was written by the transformers path (report.json `path`)."""
    f = Path(calib_dir) / "report.json"
    try:
        return json.loads(f.read_text()).get("path") == PATH
    except (OSError, json.JSONDecodeError):
        return False
