"""Fixtures and pytest hooks. The helpers the test modules share are in helpers.py."""

import json

import pytest
from helpers import (
    ROOT,
    corpus_args,
    export,
    run_ranks,
    toy_tokenizer,
    train,
    train_args,
    word_tokenizer,
    write_corpus,
)
from hypothesis import settings


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~3 s (-m 'not slow' leaves it out)")
    # The fast tier draws fewer examples in each property test (helpers.examples). This runs
    # before any test module is imported, so their @settings see the profile.
    if " ".join(config.getoption("markexpr", "").split()) == "not slow":
        settings.load_profile("fast")


@pytest.fixture(scope="session")
def toy():
    return toy_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The shipped tiny GPT-2 config, shrunk further, with dropout: so that the RNG state too
    must come back exactly on resume."""
    config = json.loads((ROOT / "assets/tiny-gpt2/config.json").read_text())
    config.update(n_layer=1, n_embd=32, n_head=2, n_positions=64, resid_pdrop=0.1,
                  embd_pdrop=0.1, attn_pdrop=0.1)
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(config))
    return path


# Finished runs to copy (helpers.copy_run) and break: never changed in place.

@pytest.fixture(scope="session")
def ten_steps(tmp_path_factory, tiny_model):
    """A run of 10 steps with checkpoints at 5 and 10, kept, to copy and break."""
    save_dir = tmp_path_factory.mktemp("ten")
    result = train(train_args(save_dir, tiny_model, name="k", max_steps=10, ckpt_freq=5,
                              val_freq=5, keep_checkpoints=0))
    assert result.returncode == 0, result.stderr
    return save_dir / "k"


@pytest.fixture(scope="session")
def four_steps(tmp_path_factory, tiny_model):
    """A finished 4-step run with checkpoints at 2 and 4 and its hf/ export, to copy."""
    save_dir = tmp_path_factory.mktemp("four")
    result = train(train_args(save_dir, tiny_model, name="k", max_steps=4, ckpt_freq=2,
                              val_freq=2, keep_checkpoints=0, sample_tokens=0))
    assert result.returncode == 0, result.stderr
    export(save_dir / "k")
    return save_dir / "k"


# The 2-rank runs of test_distributed.py and test_elastic.py: built once for both.

@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """8 shards of 40 fixed-length documents, a word tokenizer, and a held-out shard."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "train", [40] * 8, words=29)  # <bos> d<id> 29 letters <eos>: 32 tokens
    write_corpus(root / "val", [20], words=29, seed=1)
    word_tokenizer().save_pretrained(root / "tokenizer")
    return root


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, tiny_model, corpus):
    """The reference: 2 ranks x 4 sequences, uninterrupted."""
    save_dir = tmp_path_factory.mktemp("two")
    run_ranks(corpus_args(save_dir, tiny_model, corpus), ranks=2)
    return save_dir / "run"
