"""The runtime and formats import neither transformers nor datasets, and do not initialise CUDA."""

import subprocess
import sys


def test_runtime_import_is_light():
    code = ("import sys, moec.runtime.loader, moec.runtime.perplexity, moec.formats.checkpoint; "
            "import torch; bad = [m for m in ('transformers', 'datasets', 'moec.calibrate') if m in sys.modules]; "
            "assert not bad, bad; assert not torch.cuda.is_initialized()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
