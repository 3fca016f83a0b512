"""`moec eval MODEL_OR_PACKED --data ptb --split test [--mode tf|dec|both] [--baseline MODEL] [--json OUT]`.

The metrics and the columns of the table it prints: docs/metrics.md.
KL without a second model in memory: `moec eval BASE --save-logits base.logits` once, then
`moec eval PACKED --baseline-logits base.logits` (moec/runtime/saved_logits.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import torch
import typer
from rich.table import Table

from ..calibrate.catalog import recipe_arg
from ..calibrate.data import load_text
from ..calibrate.sources import load_tokenizer, resolve_model, tokenize
from ..errors import UserError
from ..progress import track
from ..runtime.hf_layout import HFCheckpoint
from ..runtime.loader import kv_cache_factory, load_model, weight_bits
from ..runtime.perplexity import CONTEXT, evaluate, fp16_cache, make_windows
from ..runtime.saved_logits import LogitRecorder, SavedLogits, tokens_sha
from ..runtime.stream_eval import LayerSource, evaluate_streamed, model_bytes
from .common import base_record, console, out_console, show_table, write_json_atomic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


QUALITY = "Perplexity and KL (the default)"
LATENCY = "Decode latency (--latency; GPU only)"


def eval_(
    model: str | None = typer.Argument(None, help="packed checkpoint, HF directory, GGUF file or built-in name"),
    data: str = typer.Option("ptb", help="built-in data set, local text/json file, or hub data set",
                             rich_help_panel=QUALITY),
    split: str | None = typer.Option(None, help="split to evaluate on (default: test; a local file has none)",
                                     rich_help_panel=QUALITY),
    mode: str = typer.Option("both", help="tf (teacher-forced), dec (token-by-token through the cache) or both",
                             rich_help_panel=QUALITY),
    max_windows: int | None = typer.Option(8, "--max-windows", help="first N windows (0: all)",
                                           rich_help_panel=QUALITY),
    seq_len: int = typer.Option(1024, "--seq-len", help="tokens per evaluation window (W; the first 32 are context "
                                "only); not the KV cache's window, which is the recipe's kv.window",
                                rich_help_panel=QUALITY),
    old_window: str | None = typer.Option(None, "--window", hidden=True),  # renamed --seq-len: refused, see below
    baseline: str | None = typer.Option(None, help="model to compare against: ppl_base, delta_pct, kld, top1",
                                        rich_help_panel=QUALITY),
    batch_size: int = typer.Option(8, "--batch-size", help="windows decoded together", rich_help_panel=QUALITY),
    dtype: str = typer.Option("fp32", help="compute dtype: fp32 (reference numbers) or bf16",
                              rich_help_panel=QUALITY),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result records here"),
    save_logits: Path | None = typer.Option(None, "--save-logits", help="write this model's log-probs (fp16) at "
                                            "the scored positions, for a later --baseline-logits",
                                            rich_help_panel=QUALITY),
    baseline_logits: Path | None = typer.Option(None, "--baseline-logits", help="KL against log-probs saved by "
                                                "--save-logits (same data, split, windows), not a baseline model",
                                                rich_help_panel=QUALITY),
    stream_layers: bool = typer.Option(False, "--stream-layers", help="tf mode with one layer's weights on the "
                                       "device at a time (by itself on cuda when the model does not fit)",
                                       rich_help_panel=QUALITY),
    latency: bool = typer.Option(False, "--latency", help="decode ms/token against the HBM floor instead",
                                 rich_help_panel=LATENCY),
    random: str | None = typer.Option(None, "--random", help="random weights at a performance shape (`moec "
                                      "models`), built in memory", rich_help_panel=LATENCY),
    recipe: str | None = typer.Option(None, "--recipe", help="with --random: the recipe's codecs (a shipped "
                                      "recipe's name, `moec recipes`, or a recipe YAML)", rich_help_panel=LATENCY),
    scheme: str | None = typer.Option(None, "--scheme", help="with --random, instead of --recipe: W4A16, FP8, "
                                      "moec-e2, ... (`moec recipes`)", rich_help_panel=LATENCY),
    batches: str = typer.Option("1,16", "--batches", help="batch sizes", rich_help_panel=LATENCY),
    contexts: str = typer.Option("4k,32k,128k", "--contexts", help="contexts (k = 1024)", rich_help_panel=LATENCY),
    steps: int = typer.Option(50, "--steps", help="timed decode steps after warm-up", rich_help_panel=LATENCY),
    prefill_contexts: str = typer.Option("4k", "--prefill-contexts", help="real prefills to time",
                                         rich_help_panel=LATENCY),
    bf16_peer: bool = typer.Option(True, "--bf16-peer/--no-bf16-peer", help="with --random: the bf16 peer too",
                                   rich_help_panel=LATENCY),
    breakdown: bool = typer.Option(False, "--breakdown", help="per-kernel breakdown at batch 1, 32k",
                                   rich_help_panel=LATENCY),
    plot: Path | None = typer.Option(None, "--plot", help="PNG of ms/token against context",
                                     rich_help_panel=LATENCY),
    path: str = typer.Option("auto", "--path", help="engine (moec's own model code), transformers (transformers' "
                             "modeling code), or auto: the engine for the types it implements"),
) -> None:
    """Perplexity, KL to a baseline and effective bits; with --latency, decode speed against the HBM floor.

    Every metric and table column is defined in docs/metrics.md.
    """
    if old_window is not None:  # refused, not mapped: a --window meant as the cache's window would change the text
        raise UserError(f"--window was renamed --seq-len (tokens per evaluation window): pass --seq-len {old_window}; "
                        f"the KV cache's fp16 window is the recipe's kv.window")
    window = seq_len
    if mode not in ("tf", "dec", "both"):
        raise UserError(f"--mode must be tf, dec or both, got {mode!r}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"--device {device!r} is not available here (cpu, or cuda on a GPU machine)")
    if latency and model is not None and random is None and _transformers_path(model, path):
        _latency_transformers(model, batches, contexts, steps, json_out)
        return
    if latency:
        from .latency_cmd import latency as run_latency

        run_latency(model, random, recipe_arg(recipe, scheme, required=False), batches, contexts, steps,
                    prefill_contexts, bf16_peer, breakdown, json_out, plot)
        return
    if random is not None:  # a performance shape has random weights and no tokenizer: nothing to score
        raise UserError(f"--random {random} is for speed runs: add --latency (GPU); perplexity needs a real MODEL")
    if recipe is not None or scheme is not None:  # a packed MODEL carries its recipe
        raise UserError("--recipe / --scheme are for --latency --random SHAPE (a packed MODEL carries its recipe)")
    if model is None:
        raise UserError("eval needs MODEL (a packed checkpoint, HF directory, GGUF file or built-in name)")
    if baseline is not None and baseline_logits is not None:
        raise UserError("--baseline and --baseline-logits both give the baseline; pass one")
    if window <= CONTEXT + 1:
        raise UserError(f"--seq-len must exceed the {CONTEXT}-token context, got {window}")
    model_dir = resolve_model(model)
    generic = _transformers_path(model, path)
    if generic and stream_layers:
        raise UserError("--stream-layers is moec's engine's; the transformers path evaluates the whole model")
    src = None
    if not generic and (stream_layers or device == "cuda"):
        src = LayerSource(model_dir, DTYPES[dtype], device)
        if not stream_layers and model_bytes(src) > 0.9 * torch.cuda.mem_get_info()[0]:
            stream_layers = True
            console.log(f"{model}: {model_bytes(src) / 1e9:.1f} GB at {dtype} does not fit the free GPU memory; "
                        f"evaluating layer by layer (--stream-layers)")
    if stream_layers:
        if mode != "tf":
            raise UserError(f"--stream-layers evaluates teacher-forced perplexity only: pass --mode tf, not {mode}")
        if baseline is not None:
            raise UserError("--stream-layers holds one model's layer at a time: give the baseline as log-probs "
                            "(`moec eval BASE --save-logits F` once, then --baseline-logits F), not --baseline")
        cand = SimpleNamespace(args=src.args)
        info = {"kind": "hf", "w_bits": weight_bits(src.hf.meta_state_dict())} if src.manifest is None else {
            "kind": "packed", "manifest": src.manifest, "w_bits": src.manifest["effective_bits"]["w_bits"]}
    elif generic:  # transformers' modeling code (moec/hf/runner.py)
        from ..hf.runner import load_runner

        cand, info = load_runner(model_dir, DTYPES[dtype], device)
    else:
        cand, info = load_model(model_dir, DTYPES[dtype], device)
    if window > cand.args.max_seq_len:
        raise UserError(f"--seq-len {window} is longer than the model supports ({cand.args.max_seq_len} tokens)")
    base = None
    if baseline is not None:
        if _transformers_path(baseline, path if not generic else "auto"):
            from ..hf.runner import load_runner

            base, _ = load_runner(resolve_model(baseline), DTYPES[dtype], device)
        else:
            base, _ = load_model(resolve_model(baseline), DTYPES[dtype], device)
        if base.args.vocab_size != cand.args.vocab_size:
            raise UserError(f"baseline {baseline!r} has another vocabulary ({base.args.vocab_size} vs "
                            f"{cand.args.vocab_size}); KL needs the same tokenizer")
    if split is None and not Path(data).is_file():  # a local file has no splits (data.py)
        split = "test"
    ids = tokenize(load_tokenizer(model_dir), load_text(data, split))
    windows = make_windows(ids, window, max_windows or None)
    if len(windows) == 0:
        where = data + (f"/{split}" if split else "")
        raise UserError(f"{where} has {ids.numel()} tokens, fewer than one window of {window}")
    modes = ["tf", "dec"] if mode == "both" else [mode]
    what = {"data": data, "split": split, "windows": len(windows), "window": window, "context": CONTEXT,
            "vocab": cand.args.vocab_size, "tokens_sha256": tokens_sha(windows)}
    saved = SavedLogits(baseline_logits, what, modes) if baseline_logits is not None else None
    record = LogitRecorder(len(windows), window - CONTEXT, cand.args.vocab_size) if save_logits else None

    recipe = info["manifest"]["recipe"]["name"] if info["kind"] == "packed" else "source"
    cache_factory = None if stream_layers else cand.cache_factory if generic else \
        kv_cache_factory(info, cand.args) or fp16_cache  # dec mode's
    records = []
    positions = len(windows) * (window - CONTEXT)  # the scored ones: progress inside a window too (perplexity.py)
    for m in modes:
        if stream_layers:
            with track("eval tf (layer by layer)", positions, "positions") as advance:
                r = evaluate_streamed(src, windows, saved=saved, record=record, progress=advance)
        else:
            label = f"eval {m} ({len(windows)} window{'s' * (len(windows) != 1)} of {window})"
            with track(label, positions, "positions") as advance:
                r = evaluate(cand, windows, m, base, batch_size=batch_size, progress=advance,
                             cache_factory=cache_factory, saved=saved, record=record)
        rec = base_record("moec-eval", device) | {
            "model": model, "method": "packed" if info["kind"] == "packed" else "source", "recipe": recipe,
            "context": window, "batch": batch_size, "mode": m, "dtype": dtype, "data": data, "split": split,
            "windows": f"{len(windows)} windows (0-{len(windows) - 1}) of {window}, scored {CONTEXT}..{window - 1}",
            "ppl": r["ppl"], "ppl_base": r.get("ppl_base"), "delta_pct": r.get("delta_pct"), "kld": r.get("kld"),
            # tf mode runs no KV cache at all: no KV bits to report
            "top1": r.get("top1"), "kv_bits": r.get("kv_bits", 16.0) if m == "dec" else None,
            "kv_bits_32k": r.get("kv_bits_32k", 16.0) if m == "dec" else None, "kv_codec": r.get("kv_codec", "fp16"),
            "w_bits": info["w_bits"], "scored_tokens": r["scored_tokens"],
            "q_bits": info["manifest"]["effective_bits"].get("q_bits") if info["kind"] == "packed" else None,
            "baseline": baseline if saved is None else f"{saved.manifest['model']} (logits {baseline_logits})",
            "stream_layers": stream_layers, "path": "transformers" if generic else "engine",
            "peer": {},
        }
        records.append(rec)
    if record is not None:
        record.save(save_logits, what | {"model": model, "model_sha256": _model_sha(model_dir, info),
                                         "dtype": dtype})
        console.log(f"wrote the log-probs of {len(windows)} windows ({', '.join(modes)}) to {save_logits}")
    _print_table(records)
    if json_out is not None:
        write_json_atomic(json_out, records)
        console.log(f"wrote {json_out}")


def _transformers_path(model: str, path: str) -> bool:
    from ..hf.runner import on_transformers_path

    return on_transformers_path(resolve_model(model), path)


def _latency_transformers(model: str, batches: str, contexts: str, steps: int, json_out: Path | None) -> None:
    """`moec eval --latency` on a model moec's engine does not run: said in one line, then the transformers
    path's decode steps timed (hf/runner.time_decode) at each batch and context."""
    from ..hf.runner import load_runner, model_type
    from .latency_cmd import parse_ints

    model_dir = resolve_model(model)
    mt = model_type(model_dir)
    console.print(f"{model}: moec's engine does not run {mt!r} (or this pack's layout); timing the transformers "
                  f"path (its own modeling code, DynamicCache), not moec's decode engine", markup=False,
                  highlight=False, soft_wrap=True)
    if not torch.cuda.is_available():
        raise UserError("--latency needs a CUDA GPU (docs/metrics.md: CPU timings are not reported as speed)")
    runner, info = load_runner(model_dir, torch.bfloat16, "cuda")
    records = []
    for b in parse_ints(batches, "--batches"):
        for ctx in parse_ints(contexts, "--contexts"):
            from ..hf.runner import time_decode

            rec = base_record("moec-latency", "cuda") | {"shape": model, "method": "transformers", "batch": b,
                                                           "context": ctx, "dtype": "bf16", "path": "transformers"}
            try:
                rec |= time_decode(runner, b, ctx, steps, "cuda")
            except Exception as e:  # a context that does not fit: recorded, the others still run
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                torch.cuda.empty_cache()
            records.append(rec)
            out_console.print(f"batch {b} context {ctx}: " + (f"{rec['ms_median']:.2f} ms/token (transformers path)"
                                                              if "ms_median" in rec else rec["error"]))
    if json_out is not None:
        write_json_atomic(json_out, records)


def _model_sha(model_dir: Path, info: dict) -> str:
    """What identifies the evaluated model: a packed checkpoint's manifest (it holds its shards' hashes),
    a source model's weight files."""
    if info["kind"] == "packed":
        return hashlib.sha256((model_dir / "moec.json").read_bytes()).hexdigest()
    return HFCheckpoint(model_dir).fingerprint()["weights_sha256"]


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_table(records: list[dict]) -> None:
    """One row per mode; the columns are defined in docs/metrics.md. KV bits are shown at the evaluated
    context (the window W) and projected to 32k tokens, since a tiered cache's fp16 window and sinks weigh
    more at a short context than at a long one."""
    ctx = records[0]["context"]
    where = records[0]["data"] + (f"/{records[0]['split']}" if records[0]["split"] else "")
    t = Table(title=f"{records[0]['model']} on {where} "
                    f"({records[0]['windows']}, {records[0]['dtype']})")
    for c in ("mode", "ppl", "ppl_base", "Δppl %", "KL", "top1", "w_bits", "q_bits", f"kv bits @{ctx}",
              "kv bits @32k"):
        t.add_column(c, justify="right")
    for r in records:
        t.add_row(r["mode"], _fmt(r["ppl"], ".4f"), _fmt(r["ppl_base"], ".4f"), _fmt(r["delta_pct"], "+.3f"),
                  _fmt(r["kld"], ".5f"), _fmt(r["top1"], ".4f"), _fmt(r["w_bits"], ".2f"),
                  _fmt(r["q_bits"], ".2f"), _fmt(r["kv_bits"], ".2f"),
                  _fmt(r["kv_bits_32k"], ".2f"))
    show_table(t)
    out_console.print("ppl is ppl_tf in the tf row and ppl_dec in the dec row; kv bits are blank in tf mode (no "
                      "cache); columns: docs/metrics.md", style="dim")
