"""The runtime and formats import neither transformers nor datasets, and do not initialise CUDA."""

import subprocess
import sys


def test_runtime_import_is_light():
    code = ("import sys, moec.runtime.loader, moec.runtime.perplexity, moec.formats.checkpoint; "
            "import torch; bad = [m for m in ('transformers', 'datasets', 'moec.calibrate') if m in sys.modules]; "
            "assert not bad, bad; assert not torch.cuda.is_initialized()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_loading_a_packed_kv_checkpoint_imports_no_calibration_code(tmp_path):
    """A packed KV checkpoint (pack --random of moec/recipes/kv-nuq2-rot.yaml at the smoke-moe shape) loaded, its
    cache built and stepped past sinks + window + a block (199 > 4 + 128 + 32 tokens: the codec encodes and
    decodes history) in a fresh
    process: not one moec.calibrate module is imported, statically or through a registry hook string."""
    from tests.cli.run import moec

    packed = tmp_path / "packed"
    r = moec("pack", "--random", "smoke-moe", "--recipe", "moec/recipes/kv-nuq2-rot.yaml", "-o", packed)
    assert r.returncode == 0, r.stderr
    code = (
        "import sys, torch\n"
        "from moec.runtime.loader import kv_cache_factory, load_model\n"
        f"model, info = load_model({str(packed)!r})\n"
        "make = kv_cache_factory(info, model.args)\n"
        "assert make is not None and info['kv']['codec'] == 'nuq-outlier', info.get('kv')\n"
        "cache = make(model, 1, 200)\n"
        "x = torch.randint(0, model.args.vocab_size, (1, 199), generator=torch.Generator().manual_seed(0))\n"
        "with torch.no_grad():\n"
        "    model(x, cache, 0)\n"
        "    y = model(x[:, -1:], cache, 199)\n"
        "assert y.shape[:2] == (1, 1) and torch.isfinite(y).all()\n"
        "bad = sorted(m for m in sys.modules if m == 'moec.calibrate' or m.startswith('moec.calibrate.'))\n"
        "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
