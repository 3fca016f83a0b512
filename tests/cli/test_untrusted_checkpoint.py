"""`moec inspect` on packed checkpoints from elsewhere, in-process (the one-line exit-2 path of a
FormatError is tests/cli/test_bad_input.py's): a random-weight pack is summarized (its manifest has no
calibration data to show: this was a KeyError), and a shard linked out of the directory is refused."""

import shutil

import pytest

from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import load_recipe
from moec.cli.inspect_cmd import inspect
from moec.errors import FormatError
from moec.runtime.config import ModelArgs

ARGS = ModelArgs(arch="mixtral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 max_seq_len=128, n_experts=4, top_k=2, expert_dim=16)


def test_inspect_random_pack_and_escaping_link(tmp_path, capsys):
    ck = tmp_path / "ck"
    pack_random(ARGS, "tiny", load_recipe("moec/recipes/experts-hls2.yaml"), ck)
    inspect(ck, None, False)
    out = capsys.readouterr().out
    assert "calibration: none (random weights, seed 0)" in out and "hls" in out, out

    shard = next(ck.glob("model-*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    with pytest.raises(FormatError, match=f"{shard.name}: links to .*outside the checkpoint directory"):
        inspect(ck, None, False)
