"""`moec generate MODEL_OR_PACKED --prompt "..." [--max-new-tokens N] [--device cpu|cuda] [--temperature T]`."""

from __future__ import annotations

import time

import torch
import typer

from ..calibrate.sources import load_tokenizer, resolve_model
from ..errors import UserError
from ..runtime.generate import generate as run_generate
from ..runtime.generate import runtime_generate
from ..runtime.loader import load_model
from .common import console, out_console

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def generate(
    model: str = typer.Argument(..., help="packed checkpoint, HF directory, GGUF file or built-in name"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="text to continue"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="tokens to generate"),
    temperature: float = typer.Option(0.0, help="0: greedy; > 0: sample from softmax(logits / T)"),
    seed: int = typer.Option(0, help="sampling seed"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    dtype: str | None = typer.Option(None, help="compute dtype: fp32 (default on cpu) or bf16 (default on cuda)"),
    stop_at_eos: bool = typer.Option(True, "--stop-at-eos/--no-stop-at-eos", help="stop at the tokenizer's EOS"),
    path: str = typer.Option("auto", "--path", help="engine (moec's own model code), transformers (transformers' "
                             "modeling code), or auto: the engine for the types it implements"),
) -> None:
    """Stream text from a model or packed checkpoint (its KV codec and expert codecs, greedy by default)."""
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"--device {device!r} is not available here (cpu, or cuda on a GPU machine)")
    dtype = dtype or ("bf16" if device == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {temperature}")
    model_dir = resolve_model(model)
    tok = load_tokenizer(model_dir)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise UserError("--prompt is empty after tokenization")
    from ..hf.runner import on_transformers_path

    generic = on_transformers_path(model_dir, path)
    with console.status(f"loading {model}"):
        if generic:  # transformers' modeling code (moec/hf/runner.py), DynamicCache
            from ..hf.runner import load_runner

            m, info = load_runner(model_dir, DTYPES[dtype], device)
        else:
            m, info = load_model(model_dir, DTYPES[dtype], device)
    if len(ids) + max_new_tokens > m.args.max_seq_len:
        raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                        f"maximum of {m.args.max_seq_len} tokens")
    out: list[int] = []
    shown = ""
    out_console.print(prompt, end="", highlight=False, markup=False)

    def on_token(t: int) -> None:
        nonlocal shown
        out.append(t)
        text = tok.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out_console.print(text[len(shown):], end="", highlight=False, markup=False, soft_wrap=True)
            shown = text

    t0 = time.perf_counter()
    eos = tok.eos_token_id if stop_at_eos else None
    if generic:
        run_generate(m, ids, max_new_tokens, temperature=temperature, seed=seed, on_token=on_token, eos_id=eos,
                 cache_factory=m.cache_factory)
    else:
        runtime_generate(m, info, ids, max_new_tokens, temperature=temperature, seed=seed, on_token=on_token,
                         eos_id=eos)
    dt = time.perf_counter() - t0
    out_console.print()
    console.print(f"[dim]{len(out)} tokens in {dt:.2f} s ({len(out) / dt:.1f} tok/s, {device}, {dtype}, "
                  f"kv {(info.get('kv') or {}).get('codec', 'fp16')}{', transformers path' * generic})[/dim]")
