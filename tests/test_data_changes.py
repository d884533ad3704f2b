"""A shard changed since the run read it (same size, shuffled, a line break moved, rows put
before, a change inside the first tokenizer batch) is refused as changed, never read at wrong
offsets nor blamed on a valid line; an unchanged shard, or one still being written, is not."""

import json
import os
import random
import tempfile
from pathlib import Path

import pytest
from helpers import (
    examples,
    refused,
    run_with_cuts,
    snapshot,
    take,
    toy_tokenizer,
    train,
    train_args,
    write_lines,
    write_shard,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data import DataError, Files, Tokenize

TOY = toy_tokenizer()


def documents(n, seed=0):
    """n records of uneven length (toy-tokenizer words), each naming itself in "doc"."""
    rng = random.Random(seed)
    return [json.dumps({"text": " ".join(rng.choices("abcdef", k=rng.randint(1, 40))),
                        "doc": i}) for i in range(n)]


def read_and_save(url, n, **args):
    """The state of a Files over ``url`` after ``n`` records, through JSON."""
    files = Files(url, **args)
    for _ in range(n):
        next(files)
    state = json.loads(json.dumps(files.state_dict()))
    files.close()
    return state


def resume_error(url, state, **args):
    files = Files(url, **args)
    files.load_state_dict(state)
    with pytest.raises(DataError) as error:
        list(files)
    return str(error.value)


@pytest.mark.parametrize("slots", [1, 4])
def test_a_same_size_shuffled_copy_is_refused_as_changed(tmp_path, slots):
    lines = documents(300)
    url = write_lines(tmp_path / "a.jsonl", lines)
    state = read_and_save(url, 150, n_active_shards=slots)
    shuffled = lines[:]
    random.Random(1).shuffle(shuffled)
    size = os.path.getsize(url)
    write_lines(tmp_path / "a.jsonl", shuffled)
    assert os.path.getsize(url) == size
    message = resume_error(url, state, n_active_shards=slots)
    assert "changed since this run read it" in message and "restore" in message, message
    assert "bad record" not in message, message


def test_a_moved_line_break_is_refused_as_changed(tmp_path):
    """The line read last before the state was saved grew by 3 bytes, the next one shrank by 3:
    the same size, and the saved offset points 3 bytes into a line."""
    lines = [json.dumps({"text": f"document {i} " + "a b c " * 5}) for i in range(100)]
    url = write_lines(tmp_path / "a.jsonl", lines)
    state = read_and_save(url, 40)
    moved = lines[:]
    moved[39] = moved[39].replace('"}', ' d "}')
    moved[40] = moved[40].replace('a b c "}', 'a b"}')
    write_lines(tmp_path / "a.jsonl", moved)
    assert os.path.getsize(url) == len("".join(line + "\n" for line in lines))
    message = resume_error(url, state)
    assert "changed since this run read it" in message and "bad record" not in message, message


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 60), suffix=st.sampled_from([".jsonl", ".jsonl.gz", ".txt"]),
       slots=st.sampled_from([1, 3]), older=st.booleans(),
       cuts=st.lists(st.integers(0, 130), min_size=1, max_size=3))
def test_an_unchanged_shard_resumes_exactly(n, suffix, slots, older, cuts):
    """Each reopen checks the line read last; an unchanged file passes, at any cut, plain,
    compressed or text, whole or cut into splits. States without "last" (as the kit saved
    them before it checked) are not checked and resume exactly too."""
    with tempfile.TemporaryDirectory() as d:
        lines = documents(n, seed=n)
        url = write_lines(Path(d) / f"a{suffix}", lines)
        if slots > 1 and suffix.endswith(".gz"):
            slots = 1  # a compressed shard is one split

        def make():
            files = Files(url, repeat=True, epochs=2, n_active_shards=slots)
            if older:  # drop "last" from the states it loads, as an older version wrote them
                load = files.load_state_dict
                files.load_state_dict = lambda s: load({**s, "slots": [
                    {k: v for k, v in slot.items() if k != "last"} for slot in s["slots"]]})
            return files
        straight = run_with_cuts(make, [], 130)
        assert len(straight) == 2 * n
        assert run_with_cuts(make, cuts, 130) == straight


@pytest.mark.slow
def test_the_trainer_refuses_a_shard_replaced_by_a_same_size_shuffle(tmp_path, tiny_model):
    """End to end: a same-size shuffled copy put in place between two runs is refused in one
    paragraph: not blamed on a valid line, nor trained on with exit 0."""
    rng = random.Random(0)
    lines = [json.dumps({"text": f"Document {i}. " + " ".join(
        rng.choices(["the", "of", "a", "kit", "data"], k=rng.randint(5, 40)))})
        for i in range(3000)]
    path = tmp_path / "one.jsonl"
    write_lines(path, lines)
    args = dict(name="s", dataset=str(path), ckpt_freq=2, val_freq=2, val_batches=1)
    result = train(train_args(tmp_path, tiny_model, max_steps=4, **args))
    assert result.returncode == 0, result.stderr[-3000:]
    rng.shuffle(lines)
    write_lines(path, lines)
    result = train(train_args(tmp_path, tiny_model, max_steps=6, **args))
    assert result.returncode != 0
    assert "changed since this run read it" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "bad record" not in result.stderr


@pytest.mark.slow
def test_resume_from_checks_the_data_before_it_lets_later_checkpoints_go(tmp_path, tiny_model):
    """--resume-from step-000002 after the shards changed (same sizes, lines shuffled): refused
    before the later checkpoints, metrics.jsonl or state.json are touched."""
    lines = [json.dumps({"text": f"document {i} " + "a b c d " * (i % 5 + 1)}) for i in range(400)]
    shards = [tmp_path / "data" / f"{k}.jsonl" for k in range(8)]
    shards[0].parent.mkdir()
    for k, shard in enumerate(shards):
        shard.write_text("".join(line + "\n" for line in lines[50 * k:50 * k + 50]))
    args = train_args(tmp_path, tiny_model, name="r", dataset=str(tmp_path / "data/*.jsonl"),
                      max_steps=6, ckpt_freq=2, val_freq=2, keep_checkpoints=0)
    assert train(args).returncode == 0
    before = snapshot(tmp_path / "r")
    for shard in shards:
        shard.write_text("".join(line + "\n" for line in reversed(shard.read_text().split(
            "\n")[:-1])))
    refused(train([*args, "--resume-from", "step-000002"]), "changed since this run read it")
    assert snapshot(tmp_path / "r") == before


@pytest.mark.parametrize("suffix", [".parquet", ".json"])
def test_rows_added_before_what_was_read_are_refused_in_row_formats(tmp_path, suffix):
    """A Parquet or JSON-array slot resumes at a row (record) index: 10 rows put before it
    would shift every later read. The row read last is checked (its crc) when it reopens."""
    records = [{"text": f"document {i}"} for i in range(40)]
    url = write_shard(tmp_path / f"a{suffix}", records, row_group_size=16)
    for n in (5, 16, 25):  # inside a row group, at its end, in the next
        state = read_and_save(url, n)
        write_shard(url, [{"text": f"new {i}"} for i in range(10)] + records,
                    row_group_size=16)
        message = resume_error(url, state)
        assert "changed since this run read it" in message and "restore" in message, message
        write_shard(url, records, row_group_size=16)
        files = Files(url)
        files.load_state_dict(state)
        assert [r["text"] for r in files] == [r["text"] for r in records[n:]]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_a_change_inside_the_first_tokenizer_batch_is_refused(tmp_path, suffix):
    """A checkpoint inside Tokenize's first batch of a shard saves Files before anything was
    read (or before a switch to the next shard): the records skipped on resume are checked."""
    records = [{"text": " ".join("abcdef"[(i + k) % 6] for k in range(i % 7 + 1))}
               for i in range(32)]
    urls = [write_shard(tmp_path / f"{k}{suffix}", records[16 * k:16 * k + 16],
                        row_group_size=4) for k in range(2)]

    def pipeline():
        return Tokenize(Files(urls), TOY, num_threads=1, batch_size=24)
    straight = take(pipeline(), 32)
    for n, changed in ((5, 0), (20, 1)):  # in shard 0's first batch; past the switch to 1
        first = pipeline()
        take(first, n)
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = pipeline()
        resumed.load_state_dict(state)
        assert take(resumed, 32 - n) == straight[n:]
        write_shard(urls[changed], [{"text": "a a"}] * 3 + records[16 * changed:][:16],
                    row_group_size=4)
        resumed = pipeline()
        resumed.load_state_dict(state)
        with pytest.raises(DataError, match="changed since this run read it"):
            take(resumed, 32 - n)
        write_shard(urls[changed], records[16 * changed:][:16], row_group_size=4)


def test_a_half_written_last_line_is_no_bad_record(tmp_path):
    """A shard still being appended to ends in a line without its newline: that is not a bad
    record to skip (the advice would drop a good document), but a file not yet complete."""
    path = tmp_path / "growing.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "c d"}\n{"text": "e')
    for skip in (False, True):
        with pytest.raises(DataError) as error:
            list(Files(str(path), skip_bad_records=skip))
        message = str(error.value)
        assert "line 3" in message and "no newline" in message and "still being written" in \
            message and "--skip-bad-records" not in message, message
    path.write_text('{"text": "a b"}\n{"text": "c d"}')  # a complete last line without "\n"
    assert [r["text"] for r in Files(str(path))] == ["a b", "c d"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_a_state_taken_after_every_record_is_the_one_taken_once(tmp_path, suffix):
    """Tokenize takes a state of Files after every record, and Files saves anew only the slots
    that read since its last state: each such state is the one a Files that reads as far and
    takes only that one saves (the line or row read last included)."""
    records = [{"text": f"document {i} " + "a b " * (i % 5)} for i in range(23)]
    urls = [write_shard(tmp_path / f"{k}{suffix}", records[k::2], row_group_size=3)
            for k in range(2)]
    args = dict(repeat=True, epochs=2, shuffle_shards=True, n_active_shards=3)
    every = Files(urls, **args)
    for n in range(2 * len(records) + 1):
        once = Files(urls, **args)
        take(once, n)
        assert json.dumps(every.state_dict()) == json.dumps(once.state_dict()), n
        once.close()
        take(every, 1)
    every.close()
