import json
import os
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORDS = ["<bos>", "<eos>", "<unk>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def toy_tokenizer(same_bos_eos=False):
    """A word-level tokenizer with predictable ids: "a" -> 3, "b" -> 4, ..., "z" -> 28."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = "<bos>" if same_bos_eos else "<eos>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=eos,
                                   unk_token="<unk>", name_or_path="toy")


@pytest.fixture(scope="session")
def toy():
    return toy_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The shipped tiny GPT-2 config, shrunk further, with dropout: so that the RNG state too
    must come back exactly on resume."""
    config = json.loads((Path(ROOT) / "assets/tiny-gpt2/config.json").read_text())
    config.update(n_layer=1, n_embd=32, n_head=2, n_positions=64, resid_pdrop=0.1,
                  embd_pdrop=0.1, attn_pdrop=0.1)
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(config))
    return path


# The 2-rank runs of test_distributed.py and test_elastic.py: built once for both.

@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """8 shards of 40 fixed-length documents, a word tokenizer, and a held-out shard."""
    from test_distributed import word_tokenizer, write_corpus
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "train", [40] * 8, words=29)  # <bos> d<id> 29 letters <eos>: 32 tokens
    write_corpus(root / "val", [20], words=29, seed=1)
    word_tokenizer().save_pretrained(root / "tokenizer")
    return root


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, tiny_model, corpus):
    """The reference: 2 ranks x 4 sequences, uninterrupted."""
    from test_distributed import args_for, run
    save_dir = tmp_path_factory.mktemp("two")
    run(args_for(save_dir, tiny_model, corpus), ranks=2)
    return save_dir / "run"
