"""The stage protocol (DESIGN.md section 2), checked on random pipelines and random cut points.

Run a pipeline straight; run it again, cutting at random points: take state_dict(), send it
through JSON, build a fresh pipeline, load_state_dict() and go on. Both runs must yield the
same items. A resumed pipeline is cut and resumed again.
"""

import gzip
import json
import os
import random
import tempfile

import pyarrow
import pyarrow.parquet
import pytest
import zstandard
from helpers import (
    LETTERS,
    Chunk,
    Count,
    Sequence,
    examples,
    records_per_split,
    run_with_cuts,
    split_capacity,
    toy_tokenizer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data import (
    Batch,
    ConcatChunk,
    EnsureBosEos,
    Files,
    Filter,
    Pack,
    Pad,
    Prefetch,
    Shuffle,
    SplitError,
    Tokenize,
)

TOKENIZER = toy_tokenizer()


def write_shards(directory, sizes, suffixes, seed):
    """Shards of random documents ("c a q ..."), some compressed or Parquet; sizes may be 0."""
    rng = random.Random(seed)
    urls = []
    for i, (size, suffix) in enumerate(zip(sizes, suffixes)):
        lines = [json.dumps({"text": " ".join(rng.choices(LETTERS, k=rng.randrange(0, 12))),
                             "doc": f"{i}-{j}"}) + "\n" for j in range(size)]
        data = "".join(lines).encode()
        if suffix == ".parquet":  # the same records, in row groups of 1 to 4 rows
            sink = pyarrow.BufferOutputStream()
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist(list(map(json.loads, lines))),
                                        sink, row_group_size=rng.randint(1, 4))
            data = sink.getvalue().to_pybytes()
        elif suffix == ".jsonl.gz":
            data = gzip.compress(data, mtime=0)
        elif suffix == ".jsonl.zst":
            data = zstandard.ZstdCompressor().compress(data)
        path = os.path.join(directory, f"shard-{i:03d}{suffix}")
        with open(path, "wb") as f:
            f.write(data)
        urls.append(path)
    return urls


pipelines = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 15), min_size=1, max_size=5),
    "suffixes": st.lists(st.sampled_from([".jsonl", ".jsonl", ".jsonl.gz", ".jsonl.zst",
                                          ".parquet"]), min_size=5, max_size=5),
    "active": st.integers(1, 4),
    "world_pick": st.integers(0, 3),  # a world size that divides "active", and a rank of it
    "rank_pick": st.integers(0, 3),
    "repeat": st.booleans(),
    "epochs": st.none() | st.integers(1, 3),
    "shuffle_shards": st.booleans(),
    "filter": st.booleans(),
    "threads": st.integers(1, 3),
    "tok_batch": st.integers(1, 6),
    "chunk": st.sampled_from(["concat", "chunk", "chunk_keep", "pad", "pack", "none"]),
    "length": st.integers(1, 9),
    "shuffle": st.none() | st.integers(1, 6),
    "batch": st.none() | st.integers(1, 3),
    "prefetch": st.none() | st.integers(1, 3),
    "seed": st.integers(0, 3),
})


def rank_of(p):
    """(rank, world size) of a random pipeline: W divides the slots."""
    divisors = [w for w in range(1, p["active"] + 1) if p["active"] % w == 0]
    world = divisors[p["world_pick"] % len(divisors)]
    return p["rank_pick"] % world, world


def build(urls, p):
    rank, world = rank_of(p)
    pipe = Files(urls, repeat=p["repeat"], epochs=p["epochs"], shuffle_shards=p["shuffle_shards"],
                 seed=p["seed"], n_active_shards=p["active"], rank=rank, world_size=world)
    if p["filter"]:
        pipe = Filter(pipe, lambda s: not s["text"].startswith("a"))
    pipe = Tokenize(pipe, TOKENIZER, num_threads=p["threads"], batch_size=p["tok_batch"])
    pipe = EnsureBosEos(pipe, TOKENIZER)
    if p["chunk"] == "concat":
        pipe = ConcatChunk(pipe, p["length"])
    elif p["chunk"] in ("chunk", "chunk_keep"):
        pipe = Chunk(pipe, p["length"], drop_remainder=p["chunk"] == "chunk")
    elif p["chunk"] == "pad":
        pipe = Pad(pipe, p["length"], pad_id=2, truncate=True)
    elif p["chunk"] == "pack":
        # Dropping over-long samples of an endless stream may drop forever, like a Filter.
        pipe = Pack(pipe, p["length"], discard_long=not p["repeat"] and p["seed"] % 2 == 1)
    if p["shuffle"]:
        pipe = Shuffle(pipe, p["shuffle"], seed=p["seed"])
    if p["batch"] and p["chunk"] in ("concat", "chunk", "pad", "pack"):  # equal lengths
        pipe = Batch(pipe, p["batch"])
    if p["prefetch"]:
        pipe = Prefetch(pipe, p["prefetch"])
    return pipe


def yields_something(urls, p):
    """Does one pass over the shards hold a document that survives the filter and Chunk?"""
    def survives(record):
        if p["filter"] and record["text"].startswith("a"):
            return False
        return p["chunk"] != "chunk" or len(record["text"].split()) + 2 >= p["length"]

    records = list(Files(urls))
    return any(map(survives, records))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=pipelines, cuts=st.lists(st.integers(0, 40), min_size=1, max_size=3))
def test_random_pipelines_resume_exactly(p, cuts):
    total = 40
    with tempfile.TemporaryDirectory() as d:
        urls = write_shards(d, p["sizes"], p["suffixes"], p["seed"])
        if len(urls) < p["active"] and split_capacity(urls) < p["active"]:
            with pytest.raises(SplitError, match="slots that must each read one"):
                build(urls, p)  # too few splits for the slots: refused, never duplicated
            return
        if p["repeat"] and sum(p["sizes"]) == 0:
            return  # an endless stream of empty shards is an error, tested elsewhere
        if p["repeat"] and p["epochs"] is None and rank_of(p)[1] > 1:
            # One rank's splits may all be empty (an error when endless): read 2 epochs.
            p = {**p, "epochs": 2}
        if p["repeat"] and not yields_something(urls, p):
            # Like a Filter that rejects everything, an endless stream whose every document is
            # filtered out or shorter than Chunk's length drops forever: make it finite.
            p = {**p, "repeat": False}
        make = lambda: build(urls, p)  # noqa: E731
        straight = run_with_cuts(make, [], total)
        assert run_with_cuts(make, cuts, total) == straight


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(0, 12), repeat=st.booleans(), shuffle=st.booleans(), take_n=st.integers(0, 30),
       cuts=st.lists(st.integers(0, 30), min_size=1, max_size=3))
def test_sequence_take_resume_exactly(n, repeat, shuffle, take_n, cuts):
    make = lambda: Count(Sequence(range(n), repeat=repeat, shuffle=shuffle, seed=7), take_n)  # noqa: E731
    straight = list(make())
    out, pipe = [], make()
    for cut in sorted(cuts):
        while len(out) < cut:
            try:
                out.append(next(pipe))
            except StopIteration:
                break
        state = json.loads(json.dumps(pipe.state_dict()))
        pipe = make()
        pipe.load_state_dict(state)
    assert out + list(pipe) == straight


@settings(max_examples=examples(60), deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=7), world=st.sampled_from([1, 2, 4]),
       slots_per_rank=st.integers(1, 2), shuffle=st.booleans(), seed=st.integers(0, 3),
       cuts=st.lists(st.integers(0, 30), max_size=2))
def test_ranks_read_only_their_slots(sizes, world, slots_per_rank, shuffle, seed, cuts):
    """Files(rank=r, world_size=W) reads every W-th record of Files(), from r: no rank reads
    another's splits."""
    with tempfile.TemporaryDirectory() as d:
        urls = write_shards(d, sizes, [".jsonl"] * len(sizes), seed)
        args = dict(repeat=True, shuffle_shards=shuffle, seed=seed,
                    n_active_shards=world * slots_per_rank)
        one_rank = Files(urls, **args)
        per_split = records_per_split(one_rank)
        # Until a slot finishes its first split every slot gives one record per round; after
        # that, at an epoch's end, each rank waits for its own slots only.
        rounds = min(per_split[:world * slots_per_rank]) if not shuffle else min(per_split)
        if rounds == 0:
            return
        global_docs = [next(one_rank)["doc"] for _ in range(rounds * world * slots_per_rank)]
        for rank in range(world):
            make = lambda: Files(urls, rank=rank, world_size=world, **args)  # noqa: E731,B023
            n = rounds * slots_per_rank
            docs = [d["doc"] for d in run_with_cuts(make, [c for c in cuts if c <= n], n)]
            # Files hands out every record it parses, so this is also all that the rank read.
            assert docs == global_docs[rank::world]


def test_resume_seeks_instead_of_reading(tmp_path):
    """A resumed Files reads (almost) nothing before its offset: measured by the kernel."""
    path = tmp_path / "big.jsonl"
    record = json.dumps({"text": "x" * 1000}) + "\n"
    path.write_text(record * 10_000)  # 10 MB
    size = path.stat().st_size
    files = Files(str(path))
    for _ in range(9_000):
        next(files)
    state = json.loads(json.dumps(files.state_dict()))
    files.close()

    def bytes_read():  # rchar: bytes this process asked read() for, page cache hits included
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])

    resumed = Files(str(path))
    before = bytes_read()
    resumed.load_state_dict(state)
    first = next(resumed)
    read = bytes_read() - before
    assert first["text"] == "x" * 1000
    assert read <= 0.01 * size, f"resuming read {read} bytes of a {size}-byte shard"
    assert len(list(resumed)) == 999
