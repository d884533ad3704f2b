import gzip
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# One thread each: faster for a model this small, and the same float sums in every process.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WORDS = ["<bos>", "<eos>", "<unk>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~10 s (-m 'not slow' leaves it out)")


def toy_tokenizer(same_bos_eos=False):
    """A word-level tokenizer with predictable ids: "a" -> 3, "b" -> 4, ..., "z" -> 28."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = "<bos>" if same_bos_eos else "<eos>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=eos,
                                   unk_token="<unk>", name_or_path="toy")


def train_args(save_dir, model, name="run", **overrides):
    """train_llm.py's flags for a run of a few seconds: 32-token sequences, 30 steps."""
    args = {"experiment-name": name, "save-dir": save_dir, "model-name": model,
            "seq-length": 32, "batch-size": 4, "max-steps": 30, "lr": 1e-2,
            "warmup-steps": 5, "log-freq": 5, "val-freq": 10, "val-batches": 2,
            "ckpt-freq": 10, "wandb": "disabled", "tokenizer-threads": 1}
    args.update({key.replace("_", "-"): value for key, value in overrides.items()})
    return [f"--{key}={value}" for key, value in args.items()]


def metrics(exp_dir):
    return [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]


def last_step(exp_dir):
    """The last step metrics.jsonl holds a whole line for (a resumed run first cuts the
    file back to its checkpoint, so this can go down)."""
    path = exp_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for(condition, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"training exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for training"
        time.sleep(0.01)


def kill_at(proc, exp_dir, step, delay=0.0, kill=None, timeout=120):
    """SIGKILL the run once it has logged ``step``, ``delay`` seconds later (in the next
    step's data fetch, its validation or a save); it must not have finished by then."""
    wait_for(lambda: last_step(exp_dir) >= step, proc, timeout)
    time.sleep(delay)
    (kill or proc.kill)()
    assert proc.wait() != 0, f"the run finished before the kill after step {step}"


def refused(result, *words):
    """A non-zero exit whose message holds these words, and no traceback."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr[-2000:])


def copy_kit(dest, script="my_train.py", create_model=None, edits=()):
    """The kit as a learner copies it into a project: train_llm.py (renamed ``script``),
    data.py and utils.py in ``dest``, without assets/ or data/; ``create_model``, source
    text, replaces the script's create_model; ``edits``: (old, new) text replaced once."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("data.py", "utils.py"):
        shutil.copy(Path(ROOT) / name, dest / name)
    text = (Path(ROOT) / "train_llm.py").read_text()
    if create_model:
        start = text.index("def create_model(args):")
        end = text.index("\n\n\ndef ", start)
        text = text[:start] + textwrap.dedent(create_model).strip() + text[end:]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (dest / script).write_text(text)
    return dest / script


def write_shard(path, records, row_group_size=2):
    """Records as a shard of the kind its name says: JSON Lines, Parquet, or a JSON array
    (.json, pretty-printed like Alpaca's alpaca_data.json); .gz compresses."""
    path = str(path)
    if path.endswith(".parquet"):
        table = pyarrow.Table.from_pylist(records) if records else pyarrow.table({"text": []})
        pyarrow.parquet.write_table(table, path, row_group_size=row_group_size)
        return path
    if ".json" in path and ".jsonl" not in path:
        body = json.dumps(records, indent=4).encode()
    else:
        body = "".join(json.dumps(r) + "\n" for r in records).encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(body, mtime=0) if path.endswith(".gz") else body)
    return path


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
