"""Token files as a source: nanoGPT's raw uint16 ids, llm.c's shards (a 256 x int32 header,
then the ids) and .npy arrays. Documents are told apart by the tokenizer's EOS; a file is cut
into token ranges like any shard, a resume seeks to its saved token, and a file that is none
of the layouts, or holds an id the tokenizer lacks, is refused naming the shard."""

import collections
import gzip
import json
import os
import tempfile

import numpy as np
import pytest
from helpers import (
    ROOT,
    Sequence,
    examples,
    jsonl,
    refused,
    run_with_cuts,
    script,
    small_disk,
    train,
    train_args,
    trainer_pipeline,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import data
from data import DataError, Files

EOS, VOCAB = 0, 3000


class Ids:
    """What Files needs of a tokenizer to read token files: its EOS and its size."""
    eos_token_id = EOS

    def __len__(self):
        return VOCAB


def write_tokens(path, docs, layout, dtype="<u2", last_eos=True):
    """``docs`` (lists of ids) as one token file: nanoGPT and .npy put EOS after each, llm.c
    before each (as their own tools write them); ``dtype``: llm.c's "<u4" (its version 7
    header), any for .npy; without ``last_eos`` the last document of a nanoGPT or .npy file
    ends with the file."""
    ids = [t for d in docs for t in ([EOS, *d] if layout == "llmc" else [*d, EOS])]
    ids = np.array(ids[:-1] if ids and not last_eos and layout != "llmc" else ids, dtype=dtype)
    with open(path, "wb") as f:
        if layout == "npy":
            np.save(f, ids)
        elif layout == "llmc":
            header = [20240801, 7] if ids.dtype.itemsize == 4 else [20240520, 1]
            f.write(np.array([*header, len(ids)] + [0] * 253, dtype="<i4").tobytes())
        if layout != "npy":
            f.write(ids.tobytes())
    return str(path)


def documents(sizes, seed, empty=False):
    """Lists of ids without EOS; each document's first two ids say which it is. ``empty``: an
    empty document (two EOS in a row: none) after every third."""
    rng = np.random.default_rng(seed)
    return [[doc for d in range(n) for doc in
             [[f + 1, d + 1, *rng.integers(1, VOCAB, rng.choice([0, 1, 5, 40])).tolist()],
              *([[]] if empty and d % 3 == 2 else [])]] for f, n in enumerate(sizes)]


LAYOUTS = [("nanogpt", "<u2"), ("llmc", "<u2"), ("llmc", "<u4"), ("npy", "<u2"), ("npy", ">u4"),
           ("npy", "<i8")]


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.sampled_from([0, 1, 3, 9, 30]), min_size=1, max_size=4),
       layout=st.sampled_from(LAYOUTS), last_eos=st.booleans(), empty=st.booleans(),
       slots=st.integers(1, 8),
       world_pick=st.integers(0, 7), epochs=st.integers(1, 2), shuffle=st.booleans(),
       seed=st.integers(0, 3), cuts=st.lists(st.integers(0, 60), max_size=3),
       reshard_pick=st.integers(0, 7), reshard_at=st.integers(0, 30))
def test_token_files_give_every_document_once_per_epoch_and_resume_exactly(
        sizes, layout, last_eos, empty, slots, world_pick, epochs, shuffle, seed, cuts,
        reshard_pick, reshard_at):
    """Empty documents are none; a last document without its EOS is one."""
    divisors = [w for w in range(1, slots + 1) if slots % w == 0]
    world, new_world = (divisors[i % len(divisors)] for i in (world_pick, reshard_pick))
    docs = documents(sizes, seed, empty)
    expected = collections.Counter(tuple(d) for f in docs for d in f if d
                                   for _ in range(epochs))
    (layout, dtype) = layout
    with tempfile.TemporaryDirectory() as tmp:
        suffix = ".npy" if layout == "npy" else ".bin"
        urls = [write_tokens(f"{tmp}/part-{i}{suffix}", f, layout, dtype, last_eos)
                for i, f in enumerate(docs)]

        def make(rank=0, world_size=world):
            return Files(urls, repeat=True, epochs=epochs, shuffle_shards=shuffle, seed=seed,
                         n_active_shards=slots, rank=rank, world_size=world_size,
                         tokenizer=Ids())

        def read(rank, cut=()):
            return [tuple(r["input_ids"]) for r in run_with_cuts(lambda: make(rank), cut, 10**6)]

        streams = []
        for rank in range(world):  # cut and resumed (state through JSON): the same stream
            streams.append(read(rank))
            assert read(rank, cuts) == streams[-1]
        assert collections.Counter(d for s in streams for d in s) == expected

        # All ranks stop after reshard_at documents each; the run goes on on new_world ranks.
        pipes, before = [make(r) for r in range(world)], []
        for pipe in pipes:
            before += [tuple(r["input_ids"]) for _, r in zip(range(reshard_at), pipe)]
        states = [json.loads(json.dumps(p.state_dict())) for p in pipes]
        after = []
        for rank in range(new_world):
            pipe = make(rank, new_world)
            data.reshard(pipe, states)
            after += [tuple(r["input_ids"]) for r in pipe]
        assert collections.Counter(before + after) == expected


def test_one_token_file_is_cut_into_a_range_per_slot_and_resumed_by_seeking(tmp_path):
    """nanoGPT's single train.bin over 8 slots: 8 token ranges of about equal size, each read
    by its own slot; a resume opens the file at the saved token (it reads only the document
    read last again, to check it), not from the start."""
    docs = documents([400], seed=0)[0]
    url = write_tokens(tmp_path / "train.bin", docs, "nanogpt")
    files = Files([url], n_active_shards=8, tokenizer=Ids())
    count = sum(len(d) + 1 for d in docs)
    assert [(a, b) for _, a, b in files.splits] == [(count * j // 8, count * (j + 1) // 8)
                                                    for j in range(8)]
    first = [next(files)["input_ids"] for _ in range(300)]
    state = json.loads(json.dumps(files.state_dict()))
    opened = []
    resumed = Files([url], n_active_shards=8, tokenizer=Ids())
    open_shard = resumed.shards.open
    resumed.shards.open = lambda u, at=0: opened.append(at) or open_shard(u, at)
    resumed.load_state_dict(state)
    rest = [r["input_ids"] for r in resumed]
    assert sorted(first + rest) == sorted(docs)
    lasts = {s["token"] - s["last"][0] // 2 for s in state["slots"]}  # (bytes: uint16 ids)
    assert len(lasts) == 8 and min(lasts) > 0
    assert set(opened[:8]) == {2 * token for token in lasts}


@pytest.mark.parametrize("layout", ["nanogpt", "llmc", "npy"])
def test_bad_token_files_are_refused_naming_the_shard(tmp_path, layout):
    suffix = ".npy" if layout == "npy" else ".bin"
    docs = [[5, 6, 7], [8, 9]]
    good = write_tokens(tmp_path / f"good{suffix}", docs, layout)
    data_bytes = open(good, "rb").read()

    def refused_file(name, content, *words):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError) as e:
            list(Files([str(path)], tokenizer=Ids()))
        for word in (str(path), *words):
            assert word in str(e.value), (word, str(e.value))

    refused_file(f"short{suffix}", data_bytes[:-1], "cut short", "make it again")  # half an id
    write_tokens(tmp_path / f"big{suffix}", [[5, VOCAB + 7]], layout)
    with pytest.raises(DataError, match=rf"big{suffix}, token \d: id {VOCAB + 7} is not one of"):
        list(Files([str(tmp_path / f"big{suffix}")], tokenizer=Ids()))
    if layout == "llmc":
        header = np.frombuffer(data_bytes[:1024], "<i4").copy()
        header[1] = 3  # a version it does not know
        refused_file("version.bin", header.tobytes() + data_bytes[1024:], "version 3")
        header[1], header[2] = 1, 100  # more ids than the file holds
        refused_file("count.bin", header.tobytes() + data_bytes[1024:], "100 ids", "make it again")
        header[0], header[2] = 12345, 7  # a magic number it does not know: still a header
        refused_file("magic.bin", header.tobytes() + data_bytes[1024:], "magic 12345")
    if layout == "npy":
        np.save(tmp_path / "floats.npy", np.zeros(4))
        refused_file("floats.npy", (tmp_path / "floats.npy").read_bytes(), "integer ids")
    with pytest.raises(DataError, match="is a token file"):  # no tokenizer: no EOS
        list(Files([good]))


def test_raw_uint16_ids_with_a_larger_tokenizer_are_refused(tmp_path):
    """nanoGPT's layout has no header to say its ids are wider: a tokenizer of more ids than
    uint16 holds would read two halves of each id as two ids."""
    class Wide(Ids):
        def __len__(self):
            return 70_000

    path = write_tokens(tmp_path / "wide.bin", [[5, 6]], "nanogpt")
    with pytest.raises(DataError, match="wide.bin: raw uint16 ids, and the tokenizer has 70,000"):
        list(Files([path], tokenizer=Wide()))
    assert [r["input_ids"] for r in Files([write_tokens(tmp_path / "wide.npy", [[5, 6]], "npy",
                                                         "<u4")], tokenizer=Wide())] == [[5, 6]]


def test_tokenize_reads_ahead_a_bounded_number_of_ids(toy):
    """Token records pass Tokenize as they are, and count toward its read-ahead as text does:
    2 threads x 2 batches of 1 M characters, at 4 per id."""
    src = Sequence([{"input_ids": [4] * 300_000} for _ in range(100)])
    tokenize = data.Tokenize(src, toy, num_threads=2)
    assert next(tokenize)["input_ids"] == [4] * 300_000
    assert src.pos <= 5  # (one 1.2 M-character record per batch, 4 batches, then the next)
    tokenize.close()


def test_a_file_without_eos_is_refused_not_read_whole(tmp_path, monkeypatch):
    """Ids made by another tokenizer have no EOS where this one's is: a limit, not all memory."""
    monkeypatch.setattr(data, "MAX_DOC_TOKENS", 1000)
    path = tmp_path / "other.bin"
    np.arange(1, 5000, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match=r"other.bin: no EOS \(id 0\) in the"):
        list(Files([str(path)], tokenizer=Ids()))


def test_a_token_file_changed_before_the_saved_token_is_refused_on_resume(tmp_path):
    docs = documents([50], seed=1)[0]
    url = write_tokens(tmp_path / "t.bin", docs, "nanogpt")
    files = Files([url], tokenizer=Ids())
    for _ in range(20):
        next(files)
    state = json.loads(json.dumps(files.state_dict()))
    ids = np.fromfile(url, np.uint16)
    ids[state["slots"][0]["token"] - 2] += 1  # the last document read, same size
    ids.tofile(url)
    resumed = Files([url], tokenizer=Ids())
    resumed.load_state_dict(state)
    with pytest.raises(DataError, match="changed since this run read it"):
        next(resumed)


def test_make_token_shards_refuses_two_shards_of_one_name(tmp_path, capsys, monkeypatch):
    """C4's names keep their numbers; x.jsonl beside x.json would write x.bin twice: nothing is
    written."""
    for name in ("c4-train.00000-of-01024.json.gz", "c4-train.00001-of-01024.json.gz"):
        with gzip.open(tmp_path / name, "wt") as f:
            f.write('{"text": "a b"}\n')
    script("make_token_shards", ["--data", tmp_path / "c4-*", "--out", tmp_path / "out"],
           capsys, monkeypatch)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "c4-train.00000-of-01024.bin", "c4-train.00001-of-01024.bin"]
    for name in ("x.jsonl", "x.json"):
        (tmp_path / "two" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "two" / name).write_text('{"text": "a b"}\n')
    with pytest.raises(SystemExit, match="would both be written as .*x.bin: nothing written"):
        script("make_token_shards", ["--data", tmp_path / "two", "--out", tmp_path / "out2"],
               capsys, monkeypatch)
    assert not (tmp_path / "out2").exists()


def test_make_token_shards_never_writes_over_a_file(tmp_path, capsys, monkeypatch):
    """A file where a token file would go (perhaps the user's own, perhaps an earlier run's)
    is left as it was, and nothing is written; --out at a file is refused by name."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out/train-000.bin").write_text("MINE")
    shard = ROOT / "data/sample/prose/train-000.jsonl"
    with pytest.raises(SystemExit, match=r"train-000.bin exists \(1 of the 1 .*nothing written"):
        script("make_token_shards", ["--data", shard, "--out", tmp_path / "out"], capsys,
               monkeypatch)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["train-000.bin"]
    assert (tmp_path / "out/train-000.bin").read_text() == "MINE"
    with pytest.raises(SystemExit, match="--out .*out/train-000.bin is a file"):
        script("make_token_shards", ["--data", shard, "--out", tmp_path / "out/train-000.bin"],
               capsys, monkeypatch)


def test_make_token_shards_leaves_no_partial_token_file_and_reruns_after_a_full_disk(
        tmp_path, capsys, monkeypatch):
    """Each token file is written under a hidden .tmp name and renamed once whole: a kill
    leaves no file that --dataset OUT takes. A full disk is one paragraph naming the file; the
    command's files are removed, the half-written one too, and the same command then works."""
    (tmp_path / "text").mkdir()
    jsonl(tmp_path / "text/a.jsonl", [{"text": "a few words"}] * 10)
    jsonl(tmp_path / "text/b.jsonl", [{"text": "many more words than the disk holds"}] * 2000)
    out, argv = tmp_path / "out", ["--data", tmp_path / "text", "--out", tmp_path / "out"]
    with small_disk(16_384), pytest.raises(SystemExit) as exit_:  # a.bin fits, b.bin does not
        script("make_token_shards", argv, capsys, monkeypatch)
    message = str(exit_.value.code)
    for words in (f"writing {out / 'b.bin'} failed", "GiB free on that disk",
                  "the 1 token file(s) it wrote are removed", "the same command starts over"):
        assert words in message, (words, message)
    assert [p for p in out.rglob("*") if p.is_file()] == []
    renames, rename = [], os.rename

    def renamed(src, dst):  # what the kit would read of OUT, were the script killed now
        found = [p.name for p in out.rglob("*") if p.is_file() and data.shard_format(str(p))]
        renames.append((os.path.basename(src), found))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", renamed)
    script("make_token_shards", argv, capsys, monkeypatch)
    assert renames == [(".a.bin.tmp", []), (".b.bin.tmp", ["a.bin"])]
    assert data.expand_urls(str(out)) == [str(out / "a.bin"), str(out / "b.bin")]
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    assert sum(1 for _ in Files(data.expand_urls(str(out)), tokenizer=tokenizer)) == 2010


def test_make_token_shards_names_a_missing_tokenizer_and_a_token_file_given_as_text(
        tmp_path, capsys, monkeypatch):
    shard = ROOT / "data/sample/prose/train-000.jsonl"
    with pytest.raises(SystemExit, match="--tokenizer /nonexistent: no such file or directory"):
        script("make_token_shards", ["--data", shard, "--out", tmp_path / "o", "--tokenizer",
                                     "/nonexistent"], capsys, monkeypatch)
    made = write_tokens(tmp_path / "train.bin", [[5, 6]], "llmc")
    with pytest.raises(SystemExit, match="train.bin is a token file already"):
        script("make_token_shards", ["--data", made, "--out", tmp_path / "o"], capsys,
               monkeypatch)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["nanogpt", "llmc", "npy"])
def test_token_files_made_from_the_corpus_train_as_its_text_does(
        tmp_path, tiny_model, layout, capsys, monkeypatch):
    """make_token_shards.py turns the sample corpus into token files; a run on them is the run
    on the JSON Lines, to the bit (the same documents in the same order, the same ids)."""
    script("make_token_shards", ["--data", ROOT / "data/sample/*/train-*.jsonl", "--out",
                                 tmp_path / "shards", "--layout", layout], capsys, monkeypatch)
    suffix = "npy" if layout == "npy" else "bin"
    text = train(train_args(tmp_path, tiny_model, "text", max_steps=12, ckpt_freq=12))
    tokens = train(train_args(tmp_path, tiny_model, "tokens", max_steps=12, ckpt_freq=12,
                              dataset=tmp_path / f"shards/*/train-*.{suffix}"))
    assert text.returncode == 0 and tokens.returncode == 0, tokens.stderr[-2000:]
    a, b = ((tmp_path / name / "checkpoints/step-000012/model.pt").read_bytes()
            for name in ("text", "tokens"))
    assert a == b


def corpus_ids():
    """The shipped corpus's training documents, as the shipped tokenizer's ids."""
    docs = []
    for path in sorted(ROOT.glob("data/sample/*/train-*.jsonl")):
        docs += [json.loads(line)["text"] for line in path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    return tokenizer, tokenizer(docs, add_special_tokens=False)["input_ids"]


def test_the_trainers_pipeline_on_a_token_file_resumes_exactly(tmp_path):
    """One token file over 8 slots under the trainer's pipeline (ids, EOS-split
    documents, chunks, shuffle, batches, prefetch), cut anywhere and resumed from its state
    as a killed run resumes: the very batches of one never cut (one layout: the three resume
    alike in the reader, test_token_files_give_every_document_...)."""
    path = write_tokens(tmp_path / "train.bin", documents([100], seed=0)[0], "llmc")
    make = trainer_pipeline([f"--dataset={path}", "--seq-length=32", "--batch-size=4"])
    straight = run_with_cuts(make, [], 40)  # (about 4 epochs: 1,350 ids each)
    assert len(straight) == 40
    assert run_with_cuts(make, [1, 14, 33], 40) == straight


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["nanogpt", "llmc", "npy"])
def test_the_corpus_as_one_token_file_reshards_from_2_ranks_to_1(tmp_path, layout):
    """Both ranks stop partway; one rank reads on from their states: every document of the
    corpus once in the epoch, none skipped or repeated."""
    tokenizer, ids = corpus_ids()
    path = write_tokens(tmp_path / ("c.npy" if layout == "npy" else "c.bin"), ids, layout)

    def make(rank, world):
        return data.source(path, train=True, rank=rank, world_size=world, epochs=1,
                           tokenizer=tokenizer)

    before, states = [], []
    for rank, n in ((0, 40), (1, 25)):
        pipe = make(rank, 2)
        before += [tuple(next(pipe)["input_ids"]) for _ in range(n)]
        states.append(json.loads(json.dumps(pipe.state_dict())))
    pipe = make(0, 1)
    data.reshard(pipe, states)
    after = [tuple(r["input_ids"]) for r in pipe]
    assert collections.Counter(before + after) == collections.Counter(
        tuple(d) for d in ids if d)


def test_a_token_file_for_sft_is_refused(tmp_path, tiny_model):
    write_tokens(tmp_path / "t.bin", [[5, 6]], "nanogpt")
    refused(train(train_args(tmp_path, tiny_model, task="sft", dataset=tmp_path / "t.bin")),
            "--task sft", "a token file holds only ids")
