"""`moec inspect` on packed checkpoints from elsewhere: a random-weight pack is summarized (its manifest
has no calibration data to show), and a shard linked out of the directory is one line and exit 2."""

import shutil

from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import load_recipe
from moec.runtime.config import ModelArgs
from tests.cli.run import moec
from tests.cli.test_bad_input import assert_clean_failure

ARGS = ModelArgs(arch="mixtral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 max_seq_len=128, n_experts=4, top_k=2, expert_dim=16)


def test_inspect_random_pack_and_escaping_link(tmp_path):
    ck = tmp_path / "ck"
    pack_random(ARGS, "tiny", load_recipe("recipes/experts-hls2.yaml"), ck)
    r = moec("inspect", ck)
    assert r.returncode == 0, r.stderr
    assert "calibration: none (random weights, seed 0)" in r.stdout and "hls" in r.stdout, r.stdout

    shard = next(ck.glob("model-*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    assert_clean_failure(moec("inspect", ck), shard.name, "outside the checkpoint directory")
