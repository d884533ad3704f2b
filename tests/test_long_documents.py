"""One long document costs what its tokens cost: it is cut into pieces before tokenizing, read
ahead a bounded number of characters, and a 10 M- or 50 M-character line trains soon in bounded
memory. Tokenize resumes exactly whatever its batches (DESIGN.md sections 2 and 5)."""

import json
import math
import random
import resource

import pytest
from helpers import (
    Sequence,
    examples,
    older_tokenize_state,
    run_with_cuts,
    take,
    toy_tokenizer,
    train,
    train_args,
    write_lines,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import data
from data import Files, Map, Tokenize

TOY = toy_tokenizer()


@pytest.mark.slow
def test_one_huge_document_stays_bounded(tmp_path, tiny_model):
    """A 50 MB line among 20,000 normal ones: cut into pieces before tokenizing, so the first
    steps come soon, memory stays low and the loader state small."""
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"text": "lorem ipsum dolor sit amet " * 1_900_000}) + "\n")
        for i in range(20_000):
            f.write(json.dumps({"text": f"a normal document, number {i}."}) + "\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = train(train_args(tmp_path, tiny_model, name="huge", dataset=str(path),
                              max_steps=3, ckpt_freq=3, val_batches=1), timeout=60)
    assert result.returncode == 0, result.stderr
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert before / 2**20 < 3 and peak_gib < 3, f"peak RSS {peak_gib:.2f} GiB"
    assert "cut a document of 51300000 characters" in result.stderr
    loader = tmp_path / "huge/checkpoints/step-000003/loader-rank0.json"
    assert loader.stat().st_size < 5 * 2**20


@pytest.mark.slow
def test_one_ten_million_character_document_trains_soon_in_bounded_memory(tmp_path, tiny_model):
    """`train_llm.py --dataset one.jsonl` with one 10 M-character line: 8 slots cut it into 8
    splits, 7 of them empty, and the endless stream is that one document again and again.
    Tokenize reading 64 copies per batch, each re-opening the 7 empty splits that read the
    rest of the line, takes minutes and >10 GiB. (60 s is a bound on a hang, not a timing
    test: it takes a few seconds.)"""
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
    files.shards.open = lambda u, *at: opened.append(u) or real_open(u, *at)
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


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    """A state as older versions saved it (a snapshot before a batch of 8 records, 6 samples
    handed out since), loaded where each batch holds one document: the skip passes 6 batches,
    not 6 samples of the first (which has one), and the stream goes on exactly."""
    items = texts([10] * 30, seed=1)  # 19 characters each
    straight = take(Tokenize(Sequence(items, repeat=True), TOY, num_threads=1, batch_size=8), 40)
    new = Tokenize(Sequence(items, repeat=True), TOY, num_threads=1, batch_size=8)
    new.BATCH_CHARS = 19  # one document per batch
    state = older_tokenize_state(new, Sequence(items, repeat=True).state_dict(),
                                 [s["text"] for s in straight[:6]])
    new.load_state_dict(json.loads(json.dumps(state)))
    assert take(new, 34) == straight[6:]
    assert len(new._batch) == 1


def document_ends(samples):
    """How many samples end at each document's end: [0, the first's pieces, ...]."""
    ends = [0]
    for n, sample in enumerate(samples, 1):
        piece, pieces = sample.get("piece", (0, 1))
        if piece == pieces - 1:
            ends.append(n)
    return ends


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=12), seed=st.integers(0, 3),
       max_chars=st.sampled_from([None, 9]), threads=st.integers(1, 2),
       documents=st.integers(0, 20), handed=st.integers(0, 12))
def test_a_state_of_an_older_version_resumes_exactly(lengths, seed, max_chars, threads,
                                                     documents, handed):
    """Older versions saved Tokenize's upstream state before a batch, the samples handed out
    since (across documents, pieces counted) and their crc: loaded, such a state goes on
    exactly as the run that saved it would have; with another crc (the documents changed
    since) it is refused, not trained twice."""
    items = texts(lengths, seed)
    straight = take(tokenize(items, math.inf, max_chars, threads), 300)
    source = Sequence(items, repeat=True)
    take(source, documents)
    start = document_ends(straight)[documents]
    handed = straight[start:start + handed]
    state = json.loads(json.dumps(older_tokenize_state(
        tokenize(items, 25, max_chars, threads), source.state_dict(),
        [s["text"] for s in handed])))
    resumed = tokenize(items, 25, max_chars, threads)
    resumed.load_state_dict(state)
    assert take(resumed, 20) == straight[start + len(handed):][:20]
    resumed.close()
    if handed:
        changed = tokenize(items, 25, max_chars, threads)
        changed.load_state_dict({**state, "crc": state["crc"] ^ 1})
        with pytest.raises(data.DataError, match="changed since this run read it"):
            take(changed, 20)
        changed.close()


def test_a_state_of_an_older_version_resumes_but_does_not_reshard(tmp_path):
    """Its skip may run past whole documents, which no other number of ranks can place:
    a reshard is refused, saying what to do; on its own number of ranks it resumes exactly."""
    url = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "a b " * (i % 4 + 1)})
                                             for i in range(20)])

    def pipe(rank=0, world=1):
        return Tokenize(Files(url, n_active_shards=2, rank=rank, world_size=world), TOY,
                        num_threads=1, batch_size=8)
    straight = take(pipe(), 20)
    state = older_tokenize_state(pipe(), Files(url, n_active_shards=2).state_dict(),
                                 [s["text"] for s in straight[:3]])
    with pytest.raises(ValueError, match="older version.* resume on the same number of ranks"):
        data.reshard(pipe(0, 2), [state])
    resumed = pipe()
    resumed.load_state_dict(state)
    assert take(resumed, 17) == straight[3:]


def test_a_state_is_the_upstream_state_after_the_documents_handed_out(tmp_path):
    """Tokenize's state holds the upstream state after the last document it handed out whole,
    whatever it has read ahead: a Files state that a Files alone reaches after as many
    records; inside a cut document, the state before it and the pieces handed out."""
    lines = [json.dumps({"text": "a b c d e f g h i j k l" if i % 3 == 0 else "m n"})
             for i in range(30)]
    url = write_lines(tmp_path / "d.jsonl", lines)
    tokenize = Tokenize(Files(url, n_active_shards=2), TOY, num_threads=2, batch_size=4,
                        max_chars=10)
    alone = Files(url, n_active_shards=2)
    states = [alone.state_dict()]
    states += [alone.state_dict() for _ in alone]  # (the loop reads a record each time)
    documents = 0
    for _ in range(40):
        sample = next(tokenize)
        piece, pieces = sample.get("piece", (0, 1))
        documents += piece == pieces - 1
        state = tokenize.state_dict()
        if piece == pieces - 1:
            assert (state["skip"], state["upstream"]) == (0, states[documents])
        else:
            assert (state["skip"], state["upstream"]) == (piece + 1, states[documents])
    tokenize.close()


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.txt"])
def test_a_line_past_the_cap_is_refused_naming_shard_and_byte(tmp_path, monkeypatch, name):
    """No input takes the machine's memory: a line longer than MAX_LINE_BYTES (1,000 here) is
    a DataError at the byte where it starts, read no further; the lines before it come."""
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 1000)
    shard = tmp_path / name
    lines = [json.dumps({"text": "short"}) if name.endswith("jsonl") else "short"] * 2
    shard.write_text("\n".join(lines + ["x" * 5000, lines[0]]) + "\n")
    files = Files(str(shard))
    assert [next(files) for _ in range(2)]
    with pytest.raises(data.DataError, match=f"shard {shard}: the line at byte "
                       f"{2 * len(lines[0]) + 2} is longer than 1,000 bytes"):
        next(files)
