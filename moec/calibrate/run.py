"""`moec calibrate`: sample calibration text, capture statistics layer by layer, fit, write CALIB_DIR.

CALIB_DIR holds:
    calib.safetensors   fitted tensors and statistics (per-layer expert token counts, KV ranges, ...)
    report.json         provenance (model fingerprint, data, split, every source of a mix, samples,
                        seq_len, seed, tokens),
                        per-layer expert token counts and load balance, which experts fell under the
                        expert policy, and what was fitted
    recipe.yaml         the recipe as resolved (every default filled in)
The directory is written through moec.atomic.atomic_dir: a temporary sibling renamed into place when
complete. While it runs, OUT.partial/ holds a checkpoint after every layer and post-loop step, which
`--resume` continues from after an interruption (resume.py).

Under torch.distributed (`dist`, distributed.py) every rank runs the layer forward, each accumulates and
fits its share of every layer's experts, and rank 0 gathers them, fits the attention projections, saves
the checkpoints, runs the post-loop steps and writes CALIB_DIR; the other ranks return None after the
layer loop.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import __version__
from ..atomic import atomic_dir
from ..errors import UserError
from ..formats.checkpoint import is_packed
from ..progress import track
from ..provenance import created_timestamp, environment
from ..registry import kv_codec
from ..runtime.experts import pop_quant_experts
from ..runtime.hf_layout import HFCheckpoint
from ..runtime.model import rms_norm
from ..runtime.stream_eval import build_block
from .allocate import check_budgets
from .capture import ExpertTokenCounts, KVRange, run_layers
from .data import load_text
from .dataspec import check_specs, describe, parse_data, resolve_columns, sample_mix
from .distributed import Dist
from .faults import FiniteActivations, check_final_hidden, checked_global_state, checked_layer_state, fault_report
from .fit_experts import HEAD, ExpertFitter, canonical_names, plan
from .hessian import AttentionHessians, ExpertHessians, SharedHessians, accumulate_hessian
from .memory import check_memory
from .recipe import Recipe
from .resume import KILL_ENV, PartialState, refuse_without_resume, run_key
from .sources import load_tokenizer, tokenize
from .tune import holdout_split


def load_balance(counts: torch.Tensor, top_k: int) -> dict:
    """Summary of one layer's routing: fractions per expert, min/max ratio, max over uniform."""
    total = counts.sum().item()
    frac = (counts.double() / max(total, 1)).tolist()
    uniform = 1.0 / len(frac)
    return {"tokens": counts.tolist(), "fraction": [round(f, 5) for f in frac],
            "min_over_max": round(min(frac) / max(max(frac), 1e-12), 4),
            "max_over_uniform": round(max(frac) / uniform, 4), "assignments": total, "top_k": top_k}


def check_kv_attention(args, recipe) -> None:
    """UserError (one line) when the recipe's KV codec and the model's attention do not match: an MLA model
    (DeepSeek) caches one latent row per token, which only an MLA codec (registry `mla`: mla-nuq) holds, and an
    MLA codec holds nothing else; keys cached before RoPE (`rope: pre`) need RoPE on whole heads (the decode
    kernels rotate whole heads; GLM-4.5 turns half of each); attention sinks and sliding windows (gpt-oss) are
    served by the fp16 cache and the tiered block codecs."""
    if recipe.kv is None or kv_codec(recipe.kv.codec).identity:
        return
    if not args.is_mla and args.rope_dim < args.head_dim and getattr(recipe.kv, "rope", "post") == "pre":
        raise UserError(f"recipe {recipe.name!r} caches keys before RoPE (kv.rope: pre), but {args.arch} rotates "
                        f"{args.rope_dim} of each head's {args.head_dim} dims; use kv.rope: post")
    mla = kv_codec(recipe.kv.codec).mla
    if args.is_mla and not mla:
        raise UserError(f"recipe {recipe.name!r} compresses per-head keys and values (kv: {recipe.kv.codec}), but "
                        f"{args.arch} caches one MLA latent per token: use kv codec mla-nuq (recipe "
                        f"kv-mla-nuq2) or a recipe without a kv: section")
    if mla and not args.is_mla:
        raise UserError(f"recipe {recipe.name!r} compresses the MLA latent (kv: {recipe.kv.codec}), but {args.arch} "
                        f"has per-head keys and values")
    if (args.attn_sinks or args.has_windows) and not kv_codec(recipe.kv.codec).tiered:
        # the tiered block codecs take gpt-oss's sinks and leave its window layers to fp16 rings
        # (kvtiered.tiered_cache_factory); the latent and RVQ families group layers and attend without sinks
        raise UserError(f"recipe {recipe.name!r} compresses the KV cache with {recipe.kv.codec}, but {args.arch}'s "
                        f"attention sinks and sliding windows are served by the tiered block codecs only "
                        f"(nuq-outlier, kivi, fp8): e.g. latency-hls2-nuq2, or a recipe without a kv: section")


def calibrate(model_dir: Path, model_spec: str, recipe: Recipe, data: str, split: str, samples: int,
              seq_len: int, seed: int, out_dir: Path, device: str = "cpu", progress=None, resume: bool = False,
              data_config: str | None = None, text_column: str | None = None, dist: Dist | None = None,
              offload: bool = False, propagate: str = "fp", notify=None) -> dict | None:
    """offload: hidden states on the host (capture.run_layers). propagate: what feeds layer i + 1: "fp" the
    original layer i's outputs (statistics of every layer from the unquantized model), "quantized" the
    outputs of layer i with its fitted weights (one process only: the fits of a layer are on rank 0).
    notify(line): called with the memory estimate's one-line summary (memory.Estimate.summary) once it is
    checked, before the run holds any sample or weight."""
    dist = dist or Dist()
    if propagate not in ("fp", "quantized"):
        raise UserError(f"--propagate must be fp or quantized, got {propagate!r}")
    if propagate == "quantized" and dist.grouped:
        raise UserError("--propagate quantized needs every expert's fit in the process that runs the next layer: "
                        "run it in one process (no --gpus / torchrun)")
    if is_packed(model_dir):
        raise UserError(f"{model_dir}: is a packed checkpoint; calibrate the source model instead")
    if samples < 1 or seq_len < 2:
        raise UserError(f"--samples must be >= 1 and --seq-len >= 2, got {samples} and {seq_len}")
    sources = parse_data(data, split, data_config, text_column)  # one source or a mix (dataspec.py)
    check_specs(sources, samples)
    data, split = describe(sources)  # the source (NAME@CONFIG) or the whole mix, for the resume key and report
    ckpt = HFCheckpoint(model_dir)
    args = ckpt.args
    if seq_len > args.max_seq_len:
        raise UserError(f"--seq-len {seq_len} is longer than the model supports ({args.max_seq_len} tokens)")
    targets = plan(args, recipe)  # weight rules checked against the model before any work
    check_budgets(recipe, targets, canonical_names(args))  # an allocate budget no choice of widths meets: refused now
    if propagate == "quantized" and any(r.allocate for r in targets.values()):
        raise UserError("--propagate quantized feeds each layer's fitted weights forward, and `allocate` chooses "
                        "widths only once every layer is fitted: use --propagate fp with allocate")
    if dist.grouped and (shared := [n for n, r in targets.items()
                                    if any(c.shared_codebook for c in [r, *r.candidate_rules().values()])]):
        raise UserError(f"shared_codebook fits one codebook from every expert of a layer, and expert-parallel ranks "
                        f"each hold a share of them ({shared[0]}): run it in one process (no --gpus / torchrun)")
    if recipe.calibration.tune_steps:  # the held-back share must leave sequences to tune on (before any work)
        holdout_split(samples, recipe.calibration.tune_holdout, seed)
    if not resume:
        refuse_without_resume(out_dir)
    check_kv_attention(args, recipe)
    kv_cfg = recipe.kv_or_default()
    kv_spec = kv_codec(kv_cfg.codec)
    if kv_spec.check is not None:  # the KV settings against the model's shapes, before any work
        kv_spec.hook("check")(args, kv_cfg)
    torch.manual_seed(seed)
    sources = resolve_columns(sources)  # the column each source is read from, recorded in report.json
    # the tokenizer and the text (tens of seconds on a large corpus): shown, as every long step is
    with track("reading and tokenizing the calibration text", total=1 + len(sources)) as advance:
        tokenizer = load_tokenizer(model_dir)  # a chat column's template is checked here, before any weight is read
        advance()
        ids = []
        for s in sources:
            ids.append(tokenize(tokenizer, load_text(s.name, s.split, s.config, s.column, tokenizer)))
            advance()
    mem = check_memory(ckpt, recipe, samples, seq_len, device)  # before any sample or weight is held (memory.py)
    if notify is not None:
        notify(mem.summary())
    tokens, source_records = sample_mix(ids, sources, samples, seq_len, seed)

    counts, kv = ExpertTokenCounts(args), KVRange()
    observers: list = [counts, kv]
    # the KV codec's capture observer (K/V samples its fit needs), None: nothing to calibrate
    kv_sampler = kv_spec.hook("sampler")(kv_cfg, seed) if kv_spec.sampler is not None and dist.main else None
    if kv_sampler is not None:
        observers.append(kv_sampler)
    cal = recipe.calibration
    fitter = (ExpertFitter(targets, ckpt.layer_state, cal.expert_policy, cal.min_expert_tokens, dist=dist,
                            seed=seed) if targets else None)
    hessians: list = []
    if fitter is not None:  # per-expert and attention Hessians, fitted and dropped layer by layer
        if fitter.layers():
            hessians.append(ExpertHessians(args, fitter.layers(), ckpt.layer_state, fitter.on_layer, all_tokens=(
                cal.expert_policy == "all-experts-for-stats" and cal.min_expert_tokens > 0),
                experts=dist.owned(max(args.n_experts, 1)) if dist.grouped else None))
        if fitter.attention_layers() and dist.main:  # attention is not sharded: rank 0 fits it
            hessians.append(AttentionHessians(args, fitter.attention_layers(), fitter.on_attention_layer))
        if fitter.shared_layers() and dist.main:  # routers and shared experts likewise
            hessians.append(SharedHessians(fitter.shared_layers(), fitter.shared_down_layers(), ckpt.layer_state,
                                           fitter.on_shared_layer))
        observers += hessians
    fingerprint = ckpt.fingerprint()
    key = run_key(fingerprint, recipe, data, split, tokens, seed, samples, seq_len, device) | {"propagate": propagate}
    partial = PartialState(out_dir, key, {"counts": counts, "kv_range": kv, "kv_sampler": kv_sampler, "fitter": fitter})
    resumed = _open(partial, resume, dist)  # observers and RNG states restored to where an interrupted run stopped
    t0 = time.time() - (resumed.elapsed if resumed else 0.0)

    def end_of_layer(i: int, h: torch.Tensor) -> None:
        for hs in hessians:  # fit layer i now (not at layer i + 1's first event), so its checkpoint holds it
            hs.flush()  # (expert parallel: the layer's shares are gathered on rank 0 here)
        if i == args.n_layers - 1 and fitter is not None and HEAD in fitter.targets and dist.main:
            _fit_head(fitter, args, ckpt.global_state(), h, device)  # in the last layer's checkpoint
        if dist.main:
            partial.save("layers", i, time.time() - t0, hidden=h)
        elif os.environ.get(KILL_ENV) == f"rank-{dist.rank}-layer-{i}":  # tests only: a rank that dies
            os.kill(os.getpid(), signal.SIGKILL)

    def requantize(i: int):
        """Layer i with its fitted weights (propagate quantized), for the outputs that feed layer i + 1."""
        for hs in hessians:
            hs.flush()
        prefix = f"fit.layers.{i}."
        fitted = {k.removeprefix("fit."): v for k, v in (fitter.tensors if fitter else {}).items()
                  if k.startswith(prefix)}
        if not fitted:
            return None
        state = ckpt.layer_state(i)
        entries = {}
        for name in fitted:
            param = next(p for p in fitter.targets if name.startswith(p + "."))
            rule = fitter.targets[param]
            entries[name] = {"codec": rule.codec, "bits": rule.bits, "param": param,
                             "param_shape": list(state[param].shape)}
        for param in {e["param"] for e in entries.values()}:
            del state[param]
        state.update(fitted)
        return build_block(args, i, state, pop_quant_experts(state, {"tensors": entries}), torch.float32, device)

    start = 0 if resumed is None else resumed.layer + 1 if resumed.stage == "layers" else args.n_layers
    hidden = resumed.hidden if resumed is not None else None
    if dist.grouped:  # rank 0 read the checkpoint; the others start where it does, from its hidden states
        start = dist.broadcast_int(start)
        if start < 0:
            raise UserError(f"rank {dist.rank}: rank 0 refused the run (its message says why)")
        if 0 < start < args.n_layers:
            hidden = dist.broadcast(hidden, (*tokens.shape, args.dim), torch.float32)
    if progress is not None:
        for i in range(start):
            progress(i + 1, args.n_layers)
    if start < args.n_layers:
        final = run_layers(args, checked_global_state(ckpt.global_state(), str(model_dir)),
                           checked_layer_state(ckpt.layer_state, str(model_dir)), tokens,
                           [FiniteActivations(), *observers], device=device, progress=progress,
                           resume=(start, hidden) if start else None, on_layer_end=end_of_layer, offload=offload,
                           requantize=requantize if propagate == "quantized" else None)
        check_final_hidden(final, args.n_layers)
        del final
    if not dist.main:  # its shares are on rank 0, which does the rest
        return None
    if fitter is not None:
        for hs in hessians:
            hs.flush()
        fitter.allocate_bits()  # per-matrix widths at the allocate rules' budgets (allocate.py), if any
        # codebooks and scales tuned end to end against the source model (tune.py)
        if cal.tune_steps and not (resumed and resumed.done("tune")):
            fitter.tune(args, ckpt.state_dict(), tokens, cal, seed, device)
            partial.save("tune", args.n_layers - 1, time.time() - t0)
        tensors_fit = fitter.tensors
    seconds = time.time() - t0

    policy = recipe.calibration
    report = {
        "moec_version": __version__, "created": created_timestamp(),
        "model": model_spec, "model_path": str(model_dir), **fingerprint,
        "data": data, "split": split, "sources": source_records,
        "samples": samples, "seq_len": seq_len, "seed": seed, "tokens": int(tokens.numel()),
        "text_tokens": sum(int(x.numel()) for x in ids), "capture_seconds": round(seconds, 2),
        "device": device, "environment": environment(device), "recipe": recipe.name,
        "expert_policy": policy.expert_policy, "min_expert_tokens": policy.min_expert_tokens,
        "processes": dist.world, "propagate": propagate,
        "layers": [],
    }
    tensors = {}
    for i in range(args.n_layers):
        entry: dict = {"layer": i, "ffn": args.ffn_kinds[i]}
        if i in counts.counts:
            c = counts.counts[i]
            tensors[f"layers.{i}.expert_tokens"] = c
            entry["experts"] = load_balance(c, args.top_k)
            entry["experts_under_policy"] = [e for e, n in enumerate(c.tolist()) if n < policy.min_expert_tokens]
        for name in ("kv_latent",) if args.is_mla else ("k_pre", "k", "v"):
            tensors[f"layers.{i}.{name}_absmax"] = kv.stats[(i, name)].contiguous()
        if args.is_mla:  # one latent row [c (kv_lora_rank), k_rope] per token: its two parts' ranges
            lat = kv.stats[(i, "kv_latent")]
            entry["k_absmax"] = round(lat[..., args.kv_lora_rank:].max().item(), 4)  # the RoPE key
            entry["v_absmax"] = round(lat[..., : args.kv_lora_rank].max().item(), 4)  # the latent c
        else:
            entry["k_absmax"] = round(kv.stats[(i, "k")].max().item(), 4)
            entry["v_absmax"] = round(kv.stats[(i, "v")].max().item(), 4)
        if fitter is not None and i in fitter.report:
            entry["weights"] = fitter.report[i]
        report["layers"].append(entry)
    if fitter is not None:
        tensors.update(tensors_fit)
        if fitter.head_report is not None:
            report["lm_head"] = fitter.head_report
        report["fit_seconds"] = round(fitter.seconds, 2)
        if fitter.allocation:
            report["allocation"] = fitter.allocation
        if fitter.tune_report is not None:
            report["tune"] = fitter.tune_report
    report["faults"] = fault_report(report["layers"])  # what was repaired (faults.py)

    if kv_spec.fit is not None:
        if resumed and resumed.done("kv-fit"):
            kv_tensors, report["kv"] = resumed.tensors, resumed.meta["kv"]
        else:
            kv_tensors, report["kv"] = kv_spec.hook("fit")(args, kv_cfg, kv_sampler, device)
            partial.drop("kv_sampler")  # its samples are spent
            partial.save("kv-fit", args.n_layers - 1, seconds, step_tensors=kv_tensors, step_meta={"kv": report["kv"]})
        tensors.update(kv_tensors)
    _write_dir(out_dir, {"calib.safetensors": tensors, "report.json": report, "recipe.yaml": recipe.to_yaml()})
    partial.remove()
    return report


def _fit_head(fitter: ExpertFitter, args, glob: dict, h: torch.Tensor, device: str, batch: int = 8) -> None:
    """The LM head fitted with H = Σ hhᵀ over the final norm's outputs of h [N, L, D] (the hidden states
    after the last layer): the embedding table as the source weights on a tied model."""
    norm = glob["norm.weight"].to(device, torch.float32)
    H = torch.zeros(args.dim, args.dim, dtype=torch.float32, device=device)
    for s in range(0, h.shape[0], batch):
        accumulate_hessian(H, rms_norm(h[s : s + batch].to(device, torch.float32), norm, args.norm_eps)
                           .reshape(-1, args.dim))
    W = glob["tok_embeddings.weight" if args.tie_embeddings else HEAD]
    fitter.fit_head(W, H, h.shape[0] * h.shape[1])


def _open(partial: PartialState, resume: bool, dist: Dist):
    """partial.open on rank 0; under torch.distributed a refusal there is told to the other ranks (a
    resume point of -1), which stop with a pointer to rank 0's message instead of waiting for it."""
    if not dist.main:
        return None
    try:
        return partial.open(resume)
    except UserError:
        if dist.grouped:
            dist.broadcast_int(-1)
        raise


def _write_dir(out: Path, files: dict) -> None:
    size = sum(t.numel() * t.element_size() for t in files["calib.safetensors"].values())
    with atomic_dir(out, is_output=lambda p: (p / "report.json").is_file(), what="a calibration directory",
                    size_hint=size) as tmp:
        for name, content in files.items():
            if name.endswith(".safetensors"):
                save_file(content, str(tmp / name), metadata={"format": "moec-calib"})
            elif name.endswith(".json"):
                (tmp / name).write_text(json.dumps(content, indent=1))
            else:
                (tmp / name).write_text(content)
