"""Input splits: every document once per epoch, whatever the files users have.

One JSONL file, a few files of uneven size, more ranks than files, the Alpaca JSON array,
compressed shards that cannot be cut: Files cuts them into splits so that every slot of every
rank reads its own part, and nothing is read twice in an epoch or dropped.
"""

import collections
import json
import os
import random
import re
import tempfile

import pytest
from helpers import (
    ROOT,
    examples,
    records_per_split,
    run_with_cuts,
    split_capacity,
    toy_tokenizer,
    train,
    train_args,
)
from helpers import write_shard as write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import data
import train_llm
from data import DataError, Files, FilesChanged, SplitError

KINDS = [".jsonl", ".jsonl", ".jsonl.gz", ".parquet", ".json", ".json.gz"]


def corpus(directory, files, seed):
    """Shards of documents of random length (tiny to a few hundred bytes), ids "file-doc"."""
    rng = random.Random(seed)
    urls = []
    for i, (n, kind) in enumerate(files):
        docs = [{"text": " ".join(rng.choices("abcdefgh", k=rng.choice([1, 3, 30, 90]))),
                 "doc": f"{i}-{j}"} for j in range(n)]
        urls.append(write(os.path.join(directory, f"part-{i}{kind}"), docs,
                          row_group_size=rng.randint(1, 4)))
    return urls


def read_all(make, cuts=()):
    """Every record of a finite Files, cut and resumed at ``cuts`` (state through JSON)."""
    return [r["doc"] for r in run_with_cuts(make, cuts, 10**6)]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.lists(st.tuples(st.sampled_from([0, 1, 2, 5, 9, 25]), st.sampled_from(KINDS)),
                      min_size=1, max_size=5),
       slots=st.integers(1, 8), world_pick=st.integers(0, 7), epochs=st.integers(1, 3),
       shuffle=st.booleans(), seed=st.integers(0, 3),
       cuts=st.lists(st.integers(0, 60), max_size=3), reshard_pick=st.integers(0, 7),
       reshard_at=st.integers(0, 40))
def test_every_document_once_per_epoch_over_all_ranks(files, slots, world_pick, epochs, shuffle,
                                                     seed, cuts, reshard_pick, reshard_at):
    divisors = [w for w in range(1, slots + 1) if slots % w == 0]
    world, new_world = (divisors[i % len(divisors)] for i in (world_pick, reshard_pick))
    with tempfile.TemporaryDirectory() as d:
        urls = corpus(d, files, seed)

        def make(rank=0, world_size=world):
            return Files(urls, repeat=True, epochs=epochs, shuffle_shards=shuffle, seed=seed,
                         n_active_shards=slots, rank=rank, world_size=world_size)

        if len(urls) < slots and split_capacity(urls) < slots:
            with pytest.raises(SplitError, match=f"n_active_shards={slots} slots"):
                make()
            return  # refused at the start: never a silent duplicate
        everything = [f"{i}-{j}" for i, (n, _) in enumerate(files) for j in range(n)]
        expected = collections.Counter(everything * epochs)

        # Each rank reads only its own splits; together they read every document once per
        # epoch. Cut and resumed (twice, state through JSON), a rank reads the same.
        streams = []
        for rank in range(world):
            straight = read_all(lambda: make(rank))  # noqa: B023
            assert read_all(lambda: make(rank), cuts) == straight  # noqa: B023
            streams.append(straight)
        assert collections.Counter(doc for s in streams for doc in s) == expected

        # All ranks stop after reshard_at records each; the run goes on on new_world ranks.
        pipes, before = [make(r) for r in range(world)], []
        for pipe in pipes:
            before += [r["doc"] for _, r in zip(range(reshard_at), pipe)]
        states = [json.loads(json.dumps(p.state_dict())) for p in pipes]
        after = []
        for rank in range(new_world):
            pipe = make(rank, new_world)
            data.reshard(pipe, states)
            after += [r["doc"] for r in pipe]
        assert collections.Counter(before + after) == expected


@settings(max_examples=examples(40), deadline=None)
@given(lines=st.lists(st.integers(0, 80), min_size=1, max_size=4), slots=st.integers(1, 8),
       width=st.integers(10, 60))
def test_few_files_feed_every_slot_and_epochs_do_not_overlap(lines, slots, width, tmp_path_factory):
    """Equal-length documents: the slots read equal shares of a few files, and the endless
    stream is epoch after epoch of every document once (one file over 8 slots does not give
    each document 8 times in a row)."""
    d = tmp_path_factory.mktemp("few")
    urls = []
    for i, n in enumerate(lines):
        urls.append(str(d / f"f{i}.jsonl"))
        with open(urls[-1], "w") as f:
            for j in range(n):  # every line exactly `width` + 27 bytes
                f.write(json.dumps({"doc": f"{i}-{j:05d}", "text": "x" * width}) + "\n")
    files = Files(urls, repeat=True, n_active_shards=slots)
    per_split = records_per_split(files)
    if len(urls) < slots:
        assert len(per_split) == slots  # one split per slot and epoch
    if len(urls) == 1:  # equal byte ranges of equal lines: shares differ by at most one
        assert max(per_split) - min(per_split) <= 1
        assert min(per_split) >= lines[0] // slots
    if sum(per_split) == 0:
        return
    for epoch in range(3):  # each epoch of the endless stream is every document, once
        docs = [next(files)["doc"] for _ in range(sum(lines))]
        assert sorted(docs) == sorted(f"{i}-{j:05d}" for i, n in enumerate(lines)
                                      for j in range(n)), epoch
    files.close()


def test_one_big_file_over_four_ranks_each_reads_a_quarter(tmp_path):
    """One 40 MB file, 8 slots, 4 ranks: each rank reads (kernel-counted) about a quarter of
    the bytes, and together they read every document once."""
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(40_000):
            f.write(json.dumps({"doc": i, "text": "y" * random.Random(i).randrange(500, 1500)})
                    + "\n")
    size = path.stat().st_size

    def rchar():  # bytes this process asked read() for, page cache hits included
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])

    docs = []
    for rank in range(4):
        files = Files(str(path), n_active_shards=8, rank=rank, world_size=4)
        before = rchar()
        docs += [r["doc"] for r in files]
        read = rchar() - before
        assert read <= 0.35 * size, f"rank {rank} read {read / size:.0%} of the file"
    assert sorted(docs) == list(range(40_000))


def test_more_ranks_than_files_gives_every_rank_work_within_twice_the_mean(tmp_path):
    """3 files of uneven size (one 60x the others), 8 slots over 8 ranks: every rank gets
    work, and the big file is cut so that no rank's share is more than twice the mean."""
    urls = [write(tmp_path / f"f{i}.jsonl", [{"text": "z " * 20, "doc": f"{i}-{j}"}
                                               for j in range(n)])
            for i, n in enumerate([600, 10, 10])]
    totals = []
    for rank in range(8):
        docs = [r["doc"] for r in Files(urls, n_active_shards=8, rank=rank, world_size=8)]
        assert docs, f"rank {rank} has nothing to read"
        totals.append(len(docs))
    assert sum(totals) == 620 and max(totals) <= 2 * 620 / 8


def test_tiny_shards_cut_into_empty_splits_lose_nothing(tmp_path):
    """3 records over 8 slots: most splits are empty, and with shuffled epochs a slot may meet
    several empty ones in a row. It must not give up while splits with records remain."""
    array = write(tmp_path / "small.json", [{"i": i} for i in range(3)])
    lines = write(tmp_path / "tiny.jsonl", [{"i": 0}])
    for url, n in [(array, 3), (lines, 1)]:
        files = Files(url, n_active_shards=8, repeat=True, epochs=50, shuffle_shards=True)
        assert collections.Counter(r["i"] for r in files) == {i: 50 for i in range(n)}
        endless = Files(url, n_active_shards=8, repeat=True, shuffle_shards=True)
        assert len([next(endless) for _ in range(500)]) == 500


def test_a_failing_shard_is_retried_retries_times_not_more(tmp_path, monkeypatch):
    url = write(tmp_path / "a.json", [{"text": "a"}])
    opened = []

    def broken(*args, **kwargs):
        opened.append(args[0])
        raise ConnectionError("reset by peer")
    monkeypatch.setattr(data.smart_open, "open", broken)
    with pytest.raises(OSError, match="still failing after 3 retries") as error:
        Files(url, n_active_shards=2, retries=3, retry_delay=0)
    assert len(opened) == 4 and str(error.value).count("still failing") == 1


def test_a_json_array_is_cut_by_index_resumed_exactly_and_its_bad_records_named(tmp_path):
    """Alpaca's alpaca_data.json is one pretty-printed JSON array: read whole, cut by index,
    every record once, resumed exactly; gzip too. A JSON Lines file named .json still reads
    as lines."""
    records = [{"instruction": f"Say {i}.", "input": "" if i % 3 else "x", "output": str(i)}
               for i in range(50)]
    for name in ["alpaca_data.json", "alpaca_data.json.gz"]:
        url = write(tmp_path / name, records)
        make = lambda: Files(url, repeat=True, epochs=2, n_active_shards=8)  # noqa: E731,B023
        straight = [r["output"] for r in run_with_cuts(make, [], 1000)]
        assert sorted(straight) == sorted([r["output"] for r in records] * 2)
        assert [r["output"] for r in run_with_cuts(make, [3, 49, 77], 1000)] == straight
        assert json.loads(json.dumps(make().state_dict()))["slots"][0]["index"] == 0
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    assert len(list(Files(str(lines), n_active_shards=3))) == 5

    (tmp_path / "bad.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}, "c"]))
    with pytest.raises(DataError, match=r"bad.json, record 3: bad record: .*got str"):
        list(Files(str(tmp_path / "bad.json")))
    (tmp_path / "broken.json").write_text('[{"text": "a"},\n {"text": "b"')
    with pytest.raises(DataError, match=r"broken.json: not valid JSON"):
        Files(str(tmp_path / "broken.json"), n_active_shards=2)


def test_a_malformed_line_names_its_line_inside_any_split(tmp_path, caplog):
    """Line 138 of one 300-line file is read by the slot whose split holds it, within the
    first few hundred records, and reported with its line in the file, not in the split."""
    path = tmp_path / "one.jsonl"
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(300)]
    lines[137] = '{"text": "doc 137", oops}'
    path.write_text("\n".join(lines) + "\n")
    files = Files(str(path), repeat=True, n_active_shards=8, required_fields=["text"])
    with pytest.raises(DataError, match=rf"shard {path}, line 138: bad record: JSONDecodeError"):
        for _ in range(300):
            next(files)
    files = Files(str(path), n_active_shards=8, required_fields=["text"], skip_bad_records=True)
    assert sorted(r["text"] for r in files) == sorted(f"doc {i}" for i in range(300) if i != 137)
    assert files.skipped == 1 and f"shard {path}, line 138" in caplog.text


def test_data_that_cannot_feed_the_slots_is_refused_with_the_numbers(tmp_path):
    gz = write(tmp_path / "one.jsonl.gz", [{"text": "a"}] * 10)
    with pytest.raises(SplitError, match=r"only 1 input split.*n_active_shards=8 slots.*"
                                         r"--active-shards 1\b"):
        Files(gz, n_active_shards=8)
    with pytest.raises(SplitError, match="fewer than the 2 ranks"):
        Files(gz, n_active_shards=2, world_size=2)
    parquet = write(tmp_path / "two-groups.parquet", [{"text": "a"}] * 4, row_group_size=2)
    with pytest.raises(SplitError, match=r"only 2 input split.*--active-shards 2\b"):
        Files(parquet, n_active_shards=4, world_size=2)
    assert len(list(Files(parquet, n_active_shards=2, rank=1, world_size=2))) == 2


def test_the_cut_does_not_depend_on_the_world_size_and_a_changed_file_is_refused(tmp_path):
    url = write(tmp_path / "one.jsonl", [{"text": f"t {i}"} for i in range(100)])
    cuts = {tuple(Files(url, n_active_shards=8, rank=r, world_size=w).splits)
            for w in (1, 2, 4, 8) for r in range(w)}
    assert len(cuts) == 1 and len(cuts.pop()) == 8
    files = Files(url, repeat=True, n_active_shards=8)
    for _ in range(30):
        next(files)
    state = json.loads(json.dumps(files.state_dict()))
    assert len(json.dumps(state)) < 3000  # small, readable: one entry per slot
    with open(url, "a") as f:
        f.write(json.dumps({"text": "appended"}) + "\n")
    with pytest.raises(FilesChanged, match="changed size"):
        Files(url, repeat=True, n_active_shards=8).load_state_dict(state)


# -- the trainer ------------------------------------------------------------------------------

def one_file(path, n, bad_line=None):
    """n documents, each with a marker "Document 0042." that names it."""
    rng = random.Random(n)
    with open(path, "w") as f:
        for i in range(n):
            text = f"Document {i:04d}. " + " ".join(rng.choices(["the", "of", "a", "kit"], k=20))
            f.write('{"text": oops}\n' if i + 1 == bad_line else json.dumps({"text": text}) + "\n")
    return str(path)


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_on_one_file_sees_each_document_once_per_epoch(tmp_path, world):
    """`train_llm.py --dataset one.jsonl` (default 8 slots, endless), on 1 and on 2 ranks: in
    the first three quarters of an epoch of the trainer's own pipeline no document comes twice
    (before splits, each came 8 times in a row), and over two epochs each comes twice."""
    path = one_file(tmp_path / "one.jsonl", 400)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")

    def markers(epochs_flag, per_rank):
        args = train_llm.get_parser().parse_args(
            ["-e", "x", "--dataset", path, "--shuffle-buffer", "1", "--seq-length", "64",
             "--batch-size", "4", *epochs_flag])
        seen = collections.Counter()
        for rank in range(world):
            loader = train_llm.build_pipeline(path, tokenizer, args, rank, world, train=True)
            ids, found = [], []
            for batch in loader:  # sequences in order (no shuffle), so markers stay whole
                ids += [t for row in batch["input_ids"].tolist() for t in row]
                found = re.findall(r"Document (\d{4})\.", tokenizer.decode(ids))
                if len(found) >= per_rank:
                    break
            seen.update(found[:per_rank])
            loader.close()
        return seen

    first = markers([], 300 // world)
    assert sum(first.values()) == 300 and max(first.values()) == 1, first.most_common(3)
    two_epochs = markers(["--epochs", "2"], 10**6)
    assert max(two_epochs.values()) == 2 and len(two_epochs) == 400
    assert sum(two_epochs.values()) >= 800 - 12 * world  # all but the tail of the last batch


@pytest.mark.slow
def test_trainer_stops_at_a_malformed_line_of_one_file(tmp_path, tiny_model):
    path = one_file(tmp_path / "one.jsonl", 300, bad_line=138)
    result = train(train_args(tmp_path, tiny_model, dataset=path, max_steps=60,
                              shuffle_buffer=1))
    assert result.returncode != 0
    assert f"shard {path}, line 138: bad record" in result.stderr


@pytest.mark.slow
def test_the_trainer_fine_tunes_on_an_alpaca_json_array_read_by_index(tmp_path, tiny_model):
    records = [{"instruction": f"Repeat {i}.", "input": "" if i % 2 else "now",
                "output": f"{i} {i}"} for i in range(40)]
    train_file = write(tmp_path / "alpaca_data.json", records[:32])
    val_file = write(tmp_path / "alpaca_val.json", records[32:])
    result = train(train_args(tmp_path, tiny_model, task="sft", dataset=train_file,
                              val_dataset=val_file, max_steps=4, val_freq=2, seq_length=64,
                              ckpt_freq=4))
    assert result.returncode == 0, result.stderr
    state = json.loads((tmp_path / "run/checkpoints/step-000004/loader-rank0.json").read_text())
    assert "alpaca_data.json" in json.dumps(state) and '"index"' in json.dumps(state)


def test_an_epoch_with_empty_splits_on_one_rank_does_not_end_the_stream(tmp_path):
    """One long document and three short ones over 4 slots and 2 ranks: most byte ranges are
    empty, and with shuffled epochs a rank may draw only empty ones for an epoch. Its stream
    goes on (endless), or runs all its epochs (finite): together, 50 epochs of each document."""
    url = write(tmp_path / "one.jsonl", [{"text": "x" * 30_000, "d": 0}]
                + [{"text": "y", "d": i} for i in range(1, 4)])
    docs = []
    for rank in range(2):
        args = dict(repeat=True, shuffle_shards=True, n_active_shards=4, rank=rank, world_size=2)
        endless = Files(url, **args)
        assert len([next(endless) for _ in range(300)]) == 300
        docs += [r["d"] for r in Files(url, epochs=50, **args)]
    assert collections.Counter(docs) == {d: 50 for d in range(4)}


def test_reshard_moves_cut_documents_only_at_their_end(tmp_path):
    """Tokenize(max_chars) hands out pieces; a rank that stopped between two documents moves
    to another world size exactly, one that stopped inside a cut document is refused."""
    url = write(tmp_path / "d.jsonl", [{"text": "a b c d e f g h i j k l"}, {"text": "m n"}] * 4)
    tok = toy_tokenizer()

    def pipe(rank=0, world=1):
        files = Files(url, n_active_shards=2, rank=rank, world_size=world)
        return data.Tokenize(files, tok, num_threads=1, batch_size=3, max_chars=10)

    whole = [s["text"] for s in pipe()]
    assert len(whole) == 16 and "a b c d e " in whole  # cut at a blank, 3 pieces each
    for cut in range(1, 9):
        first = pipe()
        handed = [next(first) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        piece, pieces = handed[-1].get("piece", (0, 1))
        if piece < pieces - 1:  # stopped inside a cut document
            with pytest.raises(ValueError, match="inside a document that Tokenize had cut"):
                data.reshard(pipe(0, 2), [state])
            continue
        after = []
        for rank in range(2):
            resumed = pipe(rank, 2)
            data.reshard(resumed, [state])
            after += [s["text"] for s in resumed]
        assert sorted([s["text"] for s in handed] + after) == sorted(whole)
