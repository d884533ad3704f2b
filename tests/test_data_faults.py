"""Data that used to go wrong quietly or slowly: one very long document, a shard replaced by
a same-size file, a format the CLI cannot name, chat records without a chat template.

Each test fails on the data.py before its fix (see DESIGN.md sections 2 and 5).
"""

import gzip
import json
import math
import os
import random
import resource
import tempfile
from pathlib import Path

import pytest
from conftest import toy_tokenizer, write_shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_resume import run_with_cuts, take
from test_train import train, train_args

from data import DataError, Files, FormatInstructions, Map, Sequence, Tokenize

TOY = toy_tokenizer()


def write_lines(path, lines):
    """Lines (without their newlines) as a JSON Lines shard; .gz compresses."""
    body = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(body, mtime=0) if str(path).endswith(".gz") else body)
    return str(path)


def documents(n, seed=0):
    """n records of uneven length (toy-tokenizer words), each naming itself in "doc"."""
    rng = random.Random(seed)
    return [json.dumps({"text": " ".join(rng.choices("abcdef", k=rng.randint(1, 40))),
                        "doc": i}) for i in range(n)]


# -- 1. One long document costs what its tokens cost -------------------------------------------

def test_one_ten_million_character_document_trains_soon_in_bounded_memory(tmp_path, tiny_model):
    """`train_llm.py --dataset one.jsonl` with one 10 M-character line: 8 slots cut it into 8
    splits, 7 of them empty, and the endless stream is that one document again and again.
    It used to take minutes and >10 GiB: Tokenize read 64 copies per batch, and every copy
    re-opened the 7 empty splits, each reading the rest of the line. (60 s is a bound on a
    hang, not a timing test: it takes a few seconds.)"""
    path = tmp_path / "one.jsonl"
    words = "lorem ipsum dolor sit amet "
    path.write_text(json.dumps({"text": (words * (10**7 // len(words) + 1))[:10**7]}) + "\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = train(train_args(tmp_path, tiny_model, name="one", dataset=str(path), max_steps=3,
                              ckpt_freq=3, val_batches=1), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert before / 2**20 < 3 and peak_gib < 3, f"peak RSS {peak_gib:.2f} GiB"


def test_empty_splits_are_not_opened_again_in_later_epochs(tmp_path):
    """One line over 8 slots: the 7 splits that own no line start are opened once, in the
    first epoch; later epochs pass them without a read. The stream is what it was."""
    text = "a b " * 50_000
    url = write_lines(tmp_path / "one.jsonl", [json.dumps({"text": text})])
    files = Files(url, repeat=True, n_active_shards=8)
    opened, real_open = [], files.shards.open
    files.shards.open = lambda u: opened.append(u) or real_open(u)
    assert [next(files)["text"] for _ in range(20)] == [text] * 20
    assert len(opened) <= 8 + 19, f"{len(opened)} opens for 20 epochs of one document"
    # Derived from the files, not saved: a resumed Files finds the empty splits again.
    state = json.loads(json.dumps(files.state_dict()))
    resumed = Files(url, repeat=True, n_active_shards=8)
    resumed.load_state_dict(state)
    assert [next(resumed)["text"] for _ in range(3)] == [text] * 3


def test_tokenize_reads_ahead_a_bounded_number_of_characters():
    """Long documents close a batch early: what Tokenize reads ahead is about 2 * num_threads
    batches of a million characters, not 2 * num_threads * 64 documents."""
    doc = " ".join("abc" * 50_000)  # 300,000 characters
    pulled = []
    source = Map(Sequence([{"text": doc}], repeat=True), lambda s: pulled.append(1) or s)
    tokenize = Tokenize(source, TOY, num_threads=1)
    assert next(tokenize)["input_ids"][:2] == [3, 4]
    assert len(pulled) * len(doc) <= 2 * (2**20 + len(doc)), f"read {len(pulled)} documents"
    tokenize.close()


def texts(lengths, seed):
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choices("abc", k=n)), "doc": i} for i, n in enumerate(lengths)]


def tokenize(items, budget, max_chars=None, threads=1):
    """Tokenize over an endless Sequence, a batch closing at 4 records or ``budget`` chars
    (math.inf: no budget, as older versions)."""
    stage = Tokenize(Sequence(items, repeat=True), TOY, num_threads=threads, batch_size=4,
                     max_chars=max_chars)
    stage.BATCH_CHARS = budget
    return stage


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=12), seed=st.integers(0, 3),
       budgets=st.lists(st.sampled_from([math.inf, 1, 10, 25, 70]), min_size=1, max_size=4),
       max_chars=st.sampled_from([None, 9]), threads=st.integers(1, 2),
       cuts=st.lists(st.integers(0, 50), min_size=1, max_size=3))
def test_tokenize_resumes_exactly_whatever_the_batches(lengths, seed, budgets, max_chars,
                                                       threads, cuts):
    """Cut at random points, the first part run without a character budget (as older
    versions), each later one with another: the stream is that of a run that never stopped.
    A state's skip counts samples since its snapshot, and carries on into the next batch."""
    items, total = texts(lengths, seed), 50
    straight = run_with_cuts(lambda: tokenize(items, math.inf, max_chars, threads), [], total)
    parts = iter([math.inf] + budgets * len(cuts))
    assert run_with_cuts(lambda: tokenize(items, next(parts), max_chars, threads), cuts,
                         total) == straight


def test_a_skip_larger_than_the_first_batch_carries_on():
    """A state saved with 8-record batches (an older version, no budget) 6 samples in,
    loaded where each batch holds one document: the skip passes 6 batches, not 6 samples of
    the first (which has one), and the stream goes on exactly."""
    items = texts([10] * 30, seed=1)  # 19 characters each
    old = Tokenize(Sequence(items, repeat=True), TOY, num_threads=1, batch_size=8)
    old.BATCH_CHARS = math.inf
    straight = take(old, 40)
    old = Tokenize(Sequence(items, repeat=True), TOY, num_threads=1, batch_size=8)
    old.BATCH_CHARS = math.inf
    take(old, 6)
    state = json.loads(json.dumps(old.state_dict()))
    assert state["skip"] == 6
    new = Tokenize(Sequence(items, repeat=True), TOY, num_threads=1, batch_size=8)
    new.BATCH_CHARS = 19  # one document per batch
    new.load_state_dict(state)
    assert take(new, 34) == straight[6:]
    assert len(new._batch) == 1


# -- 2. A shard's identity is more than its size -----------------------------------------------

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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 60), suffix=st.sampled_from([".jsonl", ".jsonl.gz", ".txt"]),
       slots=st.sampled_from([1, 3]), older=st.booleans(),
       cuts=st.lists(st.integers(0, 130), min_size=1, max_size=3))
def test_an_unchanged_shard_resumes_exactly(n, suffix, slots, older, cuts):
    """Each reopen checks the line read last; an unchanged file passes, at any cut, plain,
    compressed or text, whole or cut into splits. States of older versions (no "last") are
    not checked and resume as before."""
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


def test_the_trainer_refuses_a_shard_replaced_by_a_same_size_shuffle(tmp_path, tiny_model):
    """End to end: a same-size shuffled copy put in place between two runs is refused in one
    paragraph, where it used to be blamed on a valid line, or trained on with exit 0."""
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


# -- 3. Formats the CLI cannot name ------------------------------------------------------------

@pytest.mark.parametrize("name", ["x.csv", "one.jsonl.orig"])
def test_a_format_the_name_does_not_tell_is_a_data_error_naming_the_flag(tmp_path, name):
    (tmp_path / name).write_text('{"text": "a"}\n')
    with pytest.raises(DataError) as error:
        Files(str(tmp_path / name))
    message = str(error.value)
    assert isinstance(error.value, ValueError)  # library callers catching ValueError still do
    for words in (name, "format='jsonl'", "--data-format jsonl|parquet|text",
                  "CSV is not read", "JSON Lines"):
        assert words in message, (words, message)


# -- 4. Chat data without a chat template ------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]}


def test_chat_records_without_a_chat_template_stop_with_shard_and_line(tmp_path):
    url = write_lines(tmp_path / "chat.jsonl", [json.dumps({"instruction": "a", "output": "b"}),
                                                json.dumps(CHAT)])
    check = FormatInstructions(None, TOY).check
    for skip in (False, True):  # unusable data, not a bad record: never skipped
        with pytest.raises(DataError) as error:
            list(Files(url, check=check, skip_bad_records=skip))
        message = str(error.value)
        for words in (f"shard {url}, line 2: ", "chat-format ('messages')", "tokenizer toy",
                      "no chat template", "--tokenizer", "instruction/output"):
            assert words in message, (words, message)
        assert "bad record" not in message
    # A bad record stays one: skipped with skip_bad_records.
    bad = write_lines(tmp_path / "bad.jsonl", ['{"instruction": "a"}', json.dumps(
        {"instruction": "a", "output": "b"})])
    assert len(list(Files(bad, check=check, skip_bad_records=True))) == 1
    # Without Files' check, FormatInstructions itself says so, as a DataError.
    with pytest.raises(DataError, match="no chat template"):
        next(FormatInstructions(Sequence([CHAT]), TOY))


def test_chat_records_pass_with_a_chat_template(tmp_path):
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    url = write_lines(tmp_path / "chat.jsonl", [json.dumps(CHAT)])
    check = FormatInstructions(None, tokenizer).check
    out = list(FormatInstructions(Files(url, check=check), tokenizer))
    assert [s["input_ids"] for s in out] == [[3, 4, 5, 6]]
    assert [s["labels"] for s in out] == [[-100, -100, 5, 6]]


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    "{% for m in messages %}{% if m['role'] == 'assistant' %}z {% endif %}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}z {% endif %}"])
def test_a_chat_record_not_ending_with_the_answer_is_a_bad_record(tmp_path, template):
    """With or without a generation prompt in the template: never a traceback, never the
    user's last turn trained as the answer; skipped with skip_bad_records."""
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = template
    asks = {"messages": CHAT["messages"] + [{"role": "user", "content": "e f"}]}
    url = write_lines(tmp_path / "chat.jsonl", [json.dumps(CHAT), json.dumps(asks)])
    check = FormatInstructions(None, tokenizer).check
    with pytest.raises(DataError, match=f"shard {url}, line 2: bad record.*not 'assistant'"):
        list(FormatInstructions(Files(url, check=check), tokenizer))
    out = list(FormatInstructions(Files(url, check=check, skip_bad_records=True), tokenizer))
    assert [s["labels"][-3:] for s in out] == [[-100, 5, 6]]  # only the record that ends so


def test_plain_text_for_sft_is_said_to_be_no_instruction_data(tmp_path):
    url = write_lines(tmp_path / "text.jsonl", [json.dumps({"text": "a b c"})])
    with pytest.raises(DataError, match="plain text .* not instruction data.*--task pretrain"):
        list(Files(url, check=FormatInstructions.check_record))
