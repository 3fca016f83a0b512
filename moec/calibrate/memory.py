"""The memory `moec calibrate` needs, estimated before capture, and the check that refuses a run that
cannot fit (listing what would).

What is estimated is the peak the run allocates above its baseline: the moment capture starts, after
the imports, the model's config, the tokenizer and the tokenized text (MemAvailable and the GPU's free
memory are read then, so the baseline is already spent). Host and GPU (under --device cuda) apart.
What is held, and where (N samples, L = seq_len, D = dim, T = N·L tokens, b = 8 sequences a batch):
  tokens [N, L] int64                          run.py (and a copy on the GPU)
  h [N, L, D] fp32, every sample's hidden      capture.run_layers, updated in place; its final RMSNorm
    states                                     holds two more [N, L, D] (x·rsqrt, weight·x) beside h
  embeddings, final norm (, lm_head)           source dtype, through capture; fp32 on the GPU to embed
  one layer's weights                          read from disk in the source dtype (again by the Hessian
                                               observer and the fitter); in fp32 on the GPU
  one batch's activations                      the forward of b·L tokens: norms, q/k/v with RoPE,
                                               attention output, the FFN's [b·L, I] intermediates
  K/V samples                                  up to max_tokens tokens per layer and name, every layer
                                               until the KV fit (nuq.KVSampler, latent.LatentSampler)
  one layer's Hessians                         hessian.ExpertHessians: E·(D² + I²) fp32 (and the
                                               all-token sums), w1/w3 in fp32; AttentionHessians D² + (H·d)²
  the fit of one layer                         fit_experts, one expert at a time: H damped in place
                                               (regularize's eye, H + λI and Cholesky factor), GPTQ's
                                               permuted H, H⁻¹ and factors, W copies, refit_lut's
                                               H·A [O, I, G·K]; w1/w3's fp32 copies freed before it
Checked against the measured peak in benchmarks/bench_memory_estimate.py (results/memory_estimate_*.json).
Codebook tuning (calibration.tune_steps) is a coarse term: the full model in fp32 plus one training
batch; it has not been measured.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..runtime.config import ModelArgs
from .recipe import Recipe

log = logging.getLogger(__name__)

F32 = 4
BATCH = 8  # sequences per forward in capture.run_layers
SKIP_ENV = "MOEC_SKIP_MEMORY_CHECK"
# The first use of torch's kernels in the process (their code pages and thread-local buffers): about
# 16 MB on the tiny test MoE, where the data is small (tests/calibrate/test_memory.py).
FIRST_USE = 16 << 20
_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class SourceSizes:
    """Bytes of the checkpoint as the capture reads it, from the safetensors headers."""

    global_bytes: int  # embeddings, final norm, lm_head unless tied (source dtype)
    layer_bytes: int  # the largest decoder layer (source dtype)
    layer_params: int  # its parameter count
    model_params: int  # every parameter (codebook tuning holds them all in fp32)
    fp32: bool  # the source is fp32: the capture's fp32 cast of a CPU layer is no copy


def source_sizes(files: list[Path], tied: bool) -> SourceSizes:
    glob, layer_b, layer_n, total, wide = 0, {}, {}, 0, True
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                sl = h.get_slice(k)
                n = 1
                for s in sl.get_shape():
                    n *= s
                nbytes = n * _DTYPE_BYTES.get(sl.get_dtype(), 4)
                total += n
                if (m := _LAYER.match(k)) is not None:
                    i = int(m.group(1))
                    layer_b[i], layer_n[i] = layer_b.get(i, 0) + nbytes, layer_n.get(i, 0) + n
                    wide &= sl.get_dtype() == "F32"
                elif k != "lm_head.weight" or not tied:
                    glob += nbytes
    top = max(layer_b, key=layer_b.get, default=0)
    return SourceSizes(glob, layer_b.get(top, 0), layer_n.get(top, 0), total, wide)


@dataclass
class Estimate:
    host: int  # bytes above the baseline
    device: int  # bytes on the GPU (0 under --device cpu, where everything is host)
    parts: dict[str, int] = field(default_factory=dict)  # the terms, for the message and the benchmark
    host_available: int | None = None  # what check_memory compared them with: MemAvailable,
    device_free: int | None = None  # the GPU's free memory (None under --device cpu)

    def summary(self) -> str:
        """The line `moec calibrate` prints, e.g. `memory estimate: host 0.64 GB (available 20.14 GB)`."""
        host = f"host {_gb(self.host)}" + (f" (available {_gb(self.host_available)})"
                                           if self.host_available is not None else "")
        gpu = f", GPU {_gb(self.device)} (free {_gb(self.device_free)})" if self.device_free is not None else ""
        return f"memory estimate: {host}{gpu}"


def kv_sample_bytes(sampler, args: ModelArgs, tokens: int) -> int:
    """Host bytes the KV codec's capture observer holds at the end of capture (all layers)."""
    from .latent import LatentSampler
    from .nuq import KVSampler

    kd = args.n_kv_heads * args.head_dim
    if isinstance(sampler, KVSampler):  # k_pre, k, v samples; per-head query sums and outer products
        q = args.n_heads * args.head_dim * (args.head_dim + 1)
        return args.n_layers * F32 * (3 * min(sampler.max_tokens, tokens) * kd + q)
    if isinstance(sampler, LatentSampler):
        return args.n_layers * F32 * len(sampler.names) * min(sampler.max_tokens, tokens) * kd
    return 0  # no sampler, or a plugin's whose footprint is unknown here


def estimate(args: ModelArgs, src: SourceSizes, targets: dict, recipe: Recipe, kv_bytes: int, samples: int,
             seq_len: int, device: str) -> Estimate:
    """Peak bytes above the capture-start baseline (see the module docstring for each term)."""
    N, L, D, V = samples, seq_len, args.dim, args.vocab_size
    Hd, I_max = args.n_heads * args.head_dim, max(args.expert_dim if args.is_moe else 0, args.dense_dim)
    cuda = device.startswith("cuda")
    tokens = N * L * 8
    hidden = N * L * D * F32
    t = min(BATCH, N) * L
    cal = recipe.calibration
    all_tokens = cal.expert_policy == "all-experts-for-stats" and cal.min_expert_tokens > 0
    # one batch's forward: about 3 live [t, D] and 3 [t, H·d] tensors (norm, q/k/v + RoPE, attention
    # output, residual) and 2 [t, I] FFN intermediates (3 more under all-token statistics); measured on
    # SmolLM2 (8 × 512, fp16 recipe: 0.11 GB above h and the weights)
    batch = t * F32 * (3 * D + 3 * Hd + (2 + 3 * all_tokens) * I_max)
    layer_f32 = src.layer_params * F32 if (cuda or not src.fp32) else 0
    hess, fit = _fit_bytes(args, targets, all_tokens)
    emb_f32 = V * D * F32 if (cuda or not src.fp32) else 0
    tune = 0
    if cal.tune_steps:  # teacher and student in fp32 (shared tensors), one batch with gradients
        tune = src.model_params * F32 + cal.tune_batch * L * F32 * (
            args.n_layers * (12 * D + 4 * Hd + 6 * I_max) + 4 * V)
    # the peak of each phase, as (device-resident, host-resident) bytes
    on_dev = {
        "capture": hidden + layer_f32 + batch + hess + fit + (tokens if cuda else 0),
        "final norm": 3 * hidden + hess + (tokens if cuda else 0),
        "embed": hidden + emb_f32 + (tokens if cuda else 0),
    }
    on_host = {
        "capture": tokens + src.global_bytes + src.layer_bytes + kv_bytes,
        "final norm": tokens + src.global_bytes + kv_bytes,
        "embed": tokens + src.global_bytes,
    }
    if tune:  # after capture: the source model (state_dict, source dtype) on the host besides
        on_dev["tune"] = tune
        on_host["tune"] = tokens + kv_bytes + src.model_params * (F32 if src.fp32 else 2)
    parts = {"hidden_states": hidden, "final_norm": 2 * hidden, "batch_activations": batch,
             "layer_weights": src.layer_bytes + layer_f32, "global_weights": src.global_bytes,
             "kv_samples": kv_bytes, "hessians": hess, "fit": fit, "tokens": tokens, "tune": tune}
    parts["first_use"] = FIRST_USE
    if cuda:
        return Estimate(FIRST_USE + max(on_host.values()), max(on_dev.values()), parts)
    return Estimate(FIRST_USE + max(on_dev[p] + on_host[p] for p in on_dev), 0, parts)


def _fit_bytes(args: ModelArgs, targets: dict, all_tokens: bool) -> tuple[int, int]:
    """(one layer's Hessians, the working set of fitting one layer) in bytes, the largest layer's."""
    from ..registry import weight_codec
    from .fit_experts import ATTN_PARAM, EXPERT_PARAM, HEAD_PARAM, ROUTER_PARAM, SHARED_PARAM

    D, Hd = args.dim, args.n_heads * args.head_dim
    hess = fit = 0
    for name, rule in targets.items():
        if (m := EXPERT_PARAM.search(name)) is not None:
            dense = args.ffn_kinds[int(m.group(1))] == "dense"
            E, I = (1, args.dense_dim) if dense else (args.n_experts, args.expert_dim)
            w13 = 2 * E * I * D * F32  # w1/w3 in fp32 (ExpertHessians), freed before the fit
            h = E * (D * D + I * I) * F32 + w13  # H1, H2
            if all_tokens and not dense:
                h += (D * D + E * I * I) * F32
            O, I_in = (D, I) if m.group(2) == "w2" else (I, D)
        elif ATTN_PARAM.search(name) is not None:
            E, h, w13 = 1, (D * D + Hd * Hd) * F32, 0
            O, I_in = (D, Hd) if ".wo." in name else (Hd if ".wq." in name else args.n_kv_heads * args.head_dim, D)
        elif (m := SHARED_PARAM.search(name) or ROUTER_PARAM.search(name)) is not None:
            S = args.shared_dim
            E, h, w13 = 1, (D * D + S * S) * F32 + 2 * S * D * F32, 2 * S * D * F32  # Hx, Hs, shared w1/w3
            O, I_in = (D, S) if name.endswith("shared.w2.weight") else (args.n_experts if ".router." in name else S, D)
        elif HEAD_PARAM.search(name) is not None:
            E, h, w13 = 1, D * D * F32, 0
            O, I_in = args.vocab_size, D
        else:
            continue
        G = I_in // rule.group_size if rule.group_size else 1
        spec = weight_codec(rule.codec)
        GK = G * (1 << rule.bits) if spec.fit_onehot else 0  # refit_lut's one-hot system
        # one expert at a time (fit_experts.on_layer): regularize's eye, H + λI and Cholesky factor, GPTQ's
        # permuted H, H⁻¹ and factors (7 I²), W, its permuted copy, W_hat and the error terms (6 O·I),
        # refit_lut's H·A and normal matrix; beside the layer's Hessians (h less the w1/w3 copies)
        f = h - w13 + F32 * (7 * I_in * I_in + 6 * O * I_in + O * I_in * GK + O * GK * GK)
        hess, fit = max(hess, h), max(fit, f)
    return hess, fit


def estimator(ckpt, recipe: Recipe):
    """est(samples, seq_len, device) -> Estimate for an HFCheckpoint and a recipe as `moec calibrate` runs
    them (the checkpoint's headers, the recipe's targets and KV sampler read once)."""
    from ..registry import kv_codec
    from .fit_experts import plan

    args, kv = ckpt.args, recipe.kv_or_default()
    spec = kv_codec(kv.codec)
    sampler = spec.hook("sampler")(kv, 0) if spec.sampler is not None else None
    src, targets = source_sizes(ckpt.files, args.tie_embeddings), plan(args, recipe)

    def est(samples: int, seq_len: int, device: str) -> Estimate:
        return estimate(args, src, targets, recipe, kv_sample_bytes(sampler, args, samples * seq_len), samples,
                        seq_len, device)

    return est


def available(device: str) -> tuple[int, int | None]:
    """(host bytes available: /proc/meminfo MemAvailable, GPU bytes free or None under --device cpu)."""
    host = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    except OSError:
        pass
    if host is None:  # not Linux: physical memory as an upper bound
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not device.startswith("cuda"):
        return host, None
    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False); "
                        "use --device cpu")
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return host, free


def check_memory(ckpt, recipe: Recipe, samples: int, seq_len: int, device: str) -> Estimate:
    """Refuse (UserError) a run whose estimate exceeds what is available, naming settings that fit.

    MOEC_SKIP_MEMORY_CHECK=1 skips the refusal (the estimate is still returned): for machines whose
    MemAvailable understates what the run may use (swap, memory being freed by others). The estimate
    returned carries what it was compared with; its summary() is the line `moec calibrate` prints."""
    est = estimator(ckpt, recipe)
    e = est(samples, seq_len, device)
    host, gpu = available(device)
    e.host_available, e.device_free = host, gpu
    log.debug("calibrate %s", e.summary())
    if e.host <= host and (gpu is None or e.device <= gpu):
        return e
    need = (f"host {_gb(e.host)} (available {_gb(host)})" if e.host > host
            else f"GPU {_gb(e.device)} (free {_gb(gpu)})")
    fits = lambda x: x.host <= host and (gpu is None or x.device <= gpu)  # noqa: E731
    options = []
    n = _largest(lambda k: fits(est(k, seq_len, device)), samples)
    if n:
        options.append(f"--samples {n}")
    length = _largest(lambda k: fits(est(samples, k, device)), seq_len)
    if length >= 2:
        options.append(f"--seq-len {length}")
    if gpu is not None and est(samples, seq_len, "cpu").host <= host:
        options.append("--device cpu")
    hint = f"; {' or '.join(options)} would fit" if options else "; no smaller setting fits either"
    msg = (f"calibrating {samples} × {seq_len} tokens needs about {need}: the hidden states alone are "
           f"{_gb(e.parts['hidden_states'])}{hint} (set {SKIP_ENV}=1 to run anyway)")
    if os.environ.get(SKIP_ENV) == "1":
        log.warning("%s; going on: %s=1", msg.split(" (set ")[0], SKIP_ENV)
        return e
    raise UserError(msg)


def _largest(ok, upper: int) -> int:
    """The largest k in [1, upper) with ok(k) (ok is monotone: smaller settings need less), or 0."""
    lo, hi = 0, upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo if lo and ok(lo) else 0


def _gb(b: int) -> str:
    return f"{b / 1e9:.2f} GB"
