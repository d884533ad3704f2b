"""Each stage on hand-written input, and bad input (DESIGN.md section 5)."""

import gzip
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
import weakref
from pathlib import Path

import pytest
import torch
import zstandard
from helpers import ROOT, Chunk, Count, Sequence, comparable, run_with_cuts, toy_tokenizer

from data import (
    Batch,
    ConcatChunk,
    EnsureBosEos,
    Files,
    FilesChanged,
    Filter,
    Map,
    Pack,
    Pad,
    Prefetch,
    Shuffle,
    Tokenize,
    expand_urls,
)


def write_jsonl(path, records):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif str(path).endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def texts(stage):
    return [s["text"] for s in stage]


def ids(stage):
    return [s["input_ids"].tolist() for s in stage]


# -- Files -----------------------------------------------------------------------------------------

def test_files_reads_shards_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    b = write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "b1"}])
    c = write_jsonl(tmp_path / "c.jsonl.zst", [{"text": "c1"}, {"text": "c2"}])
    assert texts(Files([a, b, c])) == ["a1", "a2", "b1", "c1", "c2"]


def test_files_round_robin_over_active_shards(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a1"}, {"text": "a2"}, {"text": "a3"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "b1"}])
    c = write_jsonl(tmp_path / "c.jsonl", [{"text": "c1"}, {"text": "c2"}])
    # Slot 0 reads shards 0, 2 (a, then c), slot 1 reads shard 1 (b) and then has none left.
    assert texts(Files([a, b, c], n_active_shards=2)) == ["a1", "b1", "a2", "a3", "c1", "c2"]
    # With repeat, slot 1's next shard is shard 3, which is shard 0 (a) of the next epoch: it
    # waits until slot 0 has finished epoch 0 (a and c), then both go on (slot 0 with b).
    files = Files([a, b, c], n_active_shards=2, repeat=True)
    assert [next(files)["text"] for _ in range(9)] == [
        "a1", "b1", "a2", "a3", "c1", "c2", "b1", "a1", "a2"]


def test_repeated_shards_get_a_new_order_each_epoch_reproducible_from_the_seed(tmp_path):
    urls = [write_jsonl(tmp_path / f"{i}.jsonl", [{"text": str(i)}]) for i in range(6)]
    plain = Files(urls, repeat=True)
    assert [next(plain)["text"] for _ in range(8)] == ["0", "1", "2", "3", "4", "5", "0", "1"]
    shuffled = Files(urls, repeat=True, shuffle_shards=True, seed=3)
    epochs = [[next(shuffled)["text"] for _ in range(6)] for _ in range(3)]
    assert all(sorted(e) == ["0", "1", "2", "3", "4", "5"] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "each epoch should get its own order"
    again = Files(urls, repeat=True, shuffle_shards=True, seed=3)
    assert [next(again)["text"] for _ in range(18)] == sum(epochs, [])


def test_blank_lines_and_an_empty_shard_are_skipped_but_shards_all_empty_are_refused(tmp_path,
                                                                                     caplog):
    a = write_jsonl(tmp_path / "a.jsonl", [])
    b = tmp_path / "b.jsonl"
    b.write_text('{"text": "x"}\n\n{"text": "y"}')  # blank line, no final newline
    with caplog.at_level(logging.WARNING, logger="data"):
        assert texts(Files([a, str(b)])) == ["x", "y"]
    assert "a.jsonl has no records" in caplog.text
    with pytest.raises(ValueError, match=r"1 shard\(s\) hold no records"):
        next(Files([a], repeat=True))


def test_braces_globs_and_directories_expand_to_sorted_shards_and_no_match_is_refused(tmp_path):
    for name in ["s-000.jsonl", "s-001.jsonl", "s-002.jsonl", "notes.txt"]:
        (tmp_path / name).write_text("")
    d = str(tmp_path)
    assert expand_urls(f"{d}/s-{{000..001}}.jsonl") == [f"{d}/s-000.jsonl", f"{d}/s-001.jsonl"]
    assert expand_urls(f"{d}/s-*.jsonl") == [f"{d}/s-00{i}.jsonl" for i in range(3)]
    assert expand_urls(d) == [f"{d}/s-00{i}.jsonl" for i in range(3)]  # not notes.txt
    (tmp_path / "texts").mkdir()
    for name in ["b.txt", "a.txt"]:
        (tmp_path / "texts" / name).write_text("")
    assert expand_urls(f"{d}/texts") == [f"{d}/texts/a.txt", f"{d}/texts/b.txt"]
    assert expand_urls(["s3://bucket/x-{0..1}.jsonl"]) == ["s3://bucket/x-0.jsonl",
                                                            "s3://bucket/x-1.jsonl"]
    with pytest.raises(FileNotFoundError, match="no files match"):
        expand_urls(f"{d}/missing-*.jsonl")


def test_a_path_that_exists_is_that_file_and_a_shard_is_listed_once(tmp_path):
    for name in ["x[1].jsonl", "x1.jsonl", "a*.jsonl", "ab.jsonl", "train-000.jsonl",
                 "train-001.jsonl"]:
        (tmp_path / name).write_text("")
    d = str(tmp_path)
    assert expand_urls(f"{d}/x[1].jsonl") == [f"{d}/x[1].jsonl"]  # not x1.jsonl
    assert expand_urls(f"{d}/a*.jsonl") == [f"{d}/a*.jsonl"]  # not ab.jsonl too
    assert expand_urls(f"{d}/x[0-9].jsonl") == [f"{d}/x1.jsonl"]  # no such file: a pattern
    assert expand_urls(f"{d}/{{train-000,train-00*}}.jsonl") == [  # overlapping parts
        f"{d}/train-000.jsonl", f"{d}/train-001.jsonl"]


# -- Sequence and the simple transforms ------------------------------------------------------------

def test_a_sequence_reshuffles_each_epoch_and_later_stages_cannot_change_its_items():
    assert list(Sequence([1, 2, 3])) == [1, 2, 3]
    rep = Sequence([1, 2, 3], repeat=True, shuffle=True, seed=1)
    got = [next(rep) for _ in range(9)]
    assert all(sorted(got[i:i + 3]) == [1, 2, 3] for i in (0, 3, 6))
    items = [{"text": "a"}]
    seq = Sequence(items, repeat=True)
    next(seq)["text"] = "changed"
    assert next(seq) == {"text": "a"}, "later stages must not change the next epoch's items"


def test_map_applies_filter_keeps_and_take_stops_after_n_items():
    assert list(Map(Sequence(range(4)), lambda x: x * 10)) == [0, 10, 20, 30]
    assert list(Filter(Sequence(range(6)), lambda x: x % 2)) == [1, 3, 5]
    assert list(Count(Sequence(range(6)), 2)) == [0, 1]
    assert list(Count(Sequence(range(1)), 5)) == [0]


# -- Tokenize and EnsureBosEos ---------------------------------------------------------------------

def test_tokenize_gives_the_same_ids_and_fields_with_or_without_a_fast_backend(toy):
    docs = [{"text": "a b c", "id": 1}, {"text": "z", "id": 2}, {"text": "", "id": 3}] * 5
    want = [[3, 4, 5], [28], []] * 5
    out = list(Tokenize(Sequence(docs), toy, num_threads=2, batch_size=2))
    assert [s["input_ids"] for s in out] == want
    assert [s["id"] for s in out] == [1, 2, 3] * 5, "other fields pass through"

    class SlowTokenizer:  # no Rust backend: Tokenize must fall back to __call__
        name_or_path = "slow"

        def __len__(self):
            return 29

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[3 + ord(w) - ord("a") for w in t.split()] for t in texts]}

    out = list(Tokenize(Sequence(docs), SlowTokenizer(), num_threads=3, batch_size=4))
    assert [s["input_ids"] for s in out] == want


def test_tokenize_refuses_records_without_a_text_field(toy):
    with pytest.raises(ValueError, match="no string field 'text'"):
        list(Tokenize(Sequence([{"content": "a"}]), toy))


def test_tokenize_threads_free_the_id_lists_they_made_and_hold_a_bounded_number(toy):
    """Its threads free the id lists they made, once their batch has been handed out (a list
    freed by the consumer takes the lock of the malloc arena the tokenizer allocates from);
    however long the stream, the lists alive stay bounded."""
    class Ids(list):  # a list that can be watched while alive
        pass

    freed_by = []  # the thread that freed each id list

    class Watching:  # the toy's backend, each id list it returns watched
        alive = set()  # id() of the lists not freed yet

        def encode_batch_fast(self, texts, **kwargs):
            out = [types.SimpleNamespace(ids=Ids(e.ids))
                   for e in toy.backend_tokenizer.encode_batch_fast(texts, **kwargs)]
            for e in out:
                self.alive.add(id(e.ids))
                weakref.finalize(e.ids, self.freed, id(e.ids))
            return out

        def freed(self, key):
            self.alive.discard(key)
            freed_by.append(threading.get_ident())

        def get_vocab_size(self, with_added_tokens=True):
            return toy.backend_tokenizer.get_vocab_size(with_added_tokens)

    threads, batch = 2, 16
    tokenize = Tokenize(Sequence([{"text": "a b"}, {"text": "c"}], repeat=True), Watching(),
                        num_threads=threads, batch_size=batch)
    most = 0
    for sample in itertools.islice(tokenize, 4000):
        assert sample["input_ids"] in ([3, 4], [5])
        most = max(most, len(Watching.alive))
    tokenize.close()
    # In flight and handed out: 2 * threads + 1 batches; as many again, at most, kept by a
    # thread that has not run since they were handed out.
    assert 0 < most <= 2 * (2 * threads + 1) * batch, most
    # (The consumer frees at most the last sample's list of a batch it still held.)
    by_consumer = freed_by.count(threading.get_ident())
    assert len(freed_by) > 3000 and by_consumer <= len(freed_by) / 8, (by_consumer, len(freed_by))


def test_long_documents_are_cut_into_pieces_of_one_document(toy):
    """max_chars cuts at a blank; only the first piece gets BOS and only the last EOS."""
    text = " ".join("abcdefghijklmnopqrstuvwxyz") * 3  # 155 characters
    pipe = EnsureBosEos(Tokenize(Sequence([{"text": text}, {"text": "z"}]), toy, max_chars=40),
                        toy)
    samples = list(pipe)
    pieces = [s for s in samples if "piece" in s]
    assert len(pieces) == 4 and all(len(s["text"]) <= 40 for s in pieces)
    assert "".join(s["text"] for s in pieces) == text and all(
        s["text"].endswith(" ") for s in pieces[:-1])  # words stay whole
    ids = [t for s in pieces for t in s["input_ids"]]
    bos, eos = toy.bos_token_id, toy.eos_token_id
    assert ids.count(bos) == 1 and ids[0] == bos and ids.count(eos) == 1 and ids[-1] == eos
    assert samples[-1]["input_ids"] == [bos, toy.convert_tokens_to_ids("z"), eos]


def test_bos_and_eos_are_added_only_where_missing_and_once_when_they_are_one_token(toy):
    docs = [{"input_ids": [3, 4]}, {"input_ids": [0, 3, 1]}, {"input_ids": []}]
    assert [s["input_ids"] for s in EnsureBosEos(Sequence(docs), toy)] == [
        [0, 3, 4, 1], [0, 3, 1], [0, 1]]
    gpt2_style = toy_tokenizer(same_bos_eos=True)  # bos == eos == 0: one separator per doc
    docs = [{"input_ids": [3, 4]}, {"input_ids": [0, 3, 0]}, {"input_ids": []}]
    assert [s["input_ids"] for s in EnsureBosEos(Sequence(docs), gpt2_style)] == [
        [3, 4, 0], [0, 3, 0], [0]]


# -- Chunk, ConcatChunk, Shuffle, Batch ------------------------------------------------------------

def docs_of(*lists):
    return Sequence([{"input_ids": list(x), "text": "dropped"} for x in lists])


def test_chunk_cuts_each_document_alone_and_drops_or_keeps_its_remainder():
    src = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11]]
    assert ids(Chunk(docs_of(*src), 3)) == [[1, 2, 3], [4, 5, 6], [9, 10, 11]]
    assert ids(Chunk(docs_of(*src), 3, drop_remainder=False)) == [
        [1, 2, 3], [4, 5, 6], [7], [8], [9, 10, 11]]
    out = next(Chunk(docs_of(*src), 3))
    assert set(out) == {"input_ids"} and out["input_ids"].dtype == torch.long


def test_concat_chunk_joins_documents_into_full_chunks_and_drops_the_tail():
    src = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10, 11, 12, 13], [14]]
    assert ids(ConcatChunk(docs_of(*src), 3)) == [
        [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]  # [13, 14] is the dropped final part
    assert ids(ConcatChunk(docs_of([1]), 2)) == []


def test_shuffle_is_a_seeded_permutation_that_moves_an_item_at_most_a_buffer_earlier():
    assert list(Shuffle(Sequence(range(10)), 1)) == list(range(10))
    out = list(Shuffle(Sequence(range(50)), 8, seed=1))
    assert sorted(out) == list(range(50)) and out != list(range(50))
    assert out == list(Shuffle(Sequence(range(50)), 8, seed=1))
    assert out != list(Shuffle(Sequence(range(50)), 8, seed=2))
    # A buffer of 8 can move an item at most 7 places earlier.
    assert all(pos >= item - 7 for pos, item in enumerate(out))


def test_batch_stacks_tensors_lists_other_fields_and_refuses_ragged_ones():
    src = [{"input_ids": torch.tensor([i, i]), "name": str(i)} for i in range(5)]
    out = list(Batch(Sequence(src), 2))
    assert [b["input_ids"].tolist() for b in out] == [[[0, 0], [1, 1]], [[2, 2], [3, 3]], [[4, 4]]]
    assert out[0]["name"] == ["0", "1"]
    assert len(list(Batch(Sequence(src), 2, drop_last=True))) == 2
    ragged = [{"input_ids": torch.tensor([1])}, {"input_ids": torch.tensor([1, 2])}]
    with pytest.raises(ValueError, match="cannot stack 'input_ids'"):
        next(Batch(Sequence(ragged), 2))


# -- Prefetch --------------------------------------------------------------------------------------

def test_prefetch_hands_over_every_batch_intact_while_its_process_runs_ahead():
    """The child writes the next batches into shared memory while this process copies out the
    last: never into a slot not yet copied (depth 1: one slot, reused at every item). Many
    items in flight (--grad-accum 200) share the slots' memory: the kernel is not asked for
    401 x 64 MiB, and a tensor too big for a slot then crosses by the pipe. The copies are
    this process's own."""
    batches = [{"input_ids": torch.full((16, 1024), i), "mask": torch.arange(i + 1) % 2 == 0,
                "big": torch.full((1 << 17,), i) if i in (5, 6) else i,  # (1 MiB)
                "name": str(i)} for i in range(300)]
    for depth, every in ((1, 1), (3, 2), (5, 2), (401, 200)):
        out = list(Prefetch(Sequence(batches), depth, every=every))
        assert [b["name"] for b in out] == [str(i) for i in range(300)]
        for i, (got, want) in enumerate(zip(out, batches)):
            assert all(torch.equal(got[k], want[k]) if isinstance(got[k], torch.Tensor)
                       else got[k] == want[k] for k in want), (depth, i)
        out[0]["input_ids"] += 1  # (a batch handed out is no view of the slot)
        assert torch.equal(out[1]["input_ids"], batches[1]["input_ids"])


def test_prefetch_same_items_and_errors():
    assert list(Prefetch(Sequence(range(20)), 3)) == list(range(20))

    def boom(x):
        if x == 3:
            raise RuntimeError("boom at 3")
        return x

    p = Prefetch(Map(Sequence(range(10)), boom), 2)
    assert [next(p) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="boom at 3"):
        next(p)
    with pytest.raises(RuntimeError, match="boom at 3"):
        next(p)  # stays failed
    p.close()
    p.close()
    p = Prefetch(Sequence(range(10)), 2)
    next(p)
    p.close()
    with pytest.raises(RuntimeError, match="after close"):
        next(p)  # an error, not a hang


def test_prefetch_close_ends_its_process():
    p = Prefetch(Sequence(range(100), repeat=True), 1)
    next(p)  # its process now waits for the next credit
    pid = p._pid
    assert Path(f"/proc/{pid}").exists()
    p.close()
    assert not Path(f"/proc/{pid}").exists()  # ended and reaped


@pytest.mark.parametrize("signum, why", [(signal.SIGKILL, "out-of-memory killer, or a kill -9"),
                                         (signal.SIGHUP, "SIGHUP")])
def test_a_prefetch_whose_process_was_killed_names_the_signal_in_one_paragraph(signum, why):
    """A ChildProcessError (an OSError: the trainer's one paragraph, not a broken pipe's
    traceback) that names the signal; only SIGKILL may be the kernel's OOM killer."""
    p = Prefetch(Sequence(range(100), repeat=True), 2)
    next(p)
    os.kill(p._pid, signum)
    with pytest.raises(ChildProcessError, match=r"data.Prefetch's process \(\d+\)") as error:
        for _ in range(5):  # (the items already on their way come first)
            next(p)
    assert why in str(error.value) and ("memory" in str(error.value)) == (why != "SIGHUP")
    p.close()


def next_within(p, seconds=60):
    """next(p) until it raises (5 items at most), in a thread: what it raised, or None if it
    still waits after ``seconds`` (a bound on a failure, not a wait for success)."""
    raised = []

    def take():
        try:
            for _ in range(5):
                next(p)
        except BaseException as e:  # noqa: BLE001 (told to the test)
            raised.append(e)
    taking = threading.Thread(target=take, daemon=True)
    taking.start()
    taking.join(timeout=seconds)
    return raised[0] if raised else None


def test_a_stray_sigusr1_to_the_prefetch_process_is_an_error_not_a_hang():
    """SIGUSR1 is how Prefetch ends its child's hung read once it gave up (until); one it did
    not send breaks the child's pipeline too, and next() says so instead of waiting on."""
    p = Prefetch(Sequence(range(100), repeat=True), 2)
    next(p)
    os.kill(p._pid, signal.SIGUSR1)
    error = next_within(p)
    p.close()
    assert isinstance(error, ChildProcessError) and "SIGUSR1" in str(error), error


@pytest.mark.slow
def test_a_stopped_prefetch_process_is_an_error_naming_it_not_a_hang():
    """kill -STOP of the child (or a debugger's stop): next() fails after 3 s naming it."""
    p = Prefetch(Sequence(range(100), repeat=True), 2)
    next(p)
    os.kill(p._pid, signal.SIGSTOP)
    error = next_within(p)
    os.kill(p._pid, signal.SIGCONT)
    p.close()
    assert isinstance(error, ChildProcessError) and "is stopped" in str(error), error


@pytest.mark.parametrize("hangs_at", [2, 5, 7])
def test_a_prefetch_given_up_on_a_hung_read_resumes_at_the_last_whole_step(hangs_at):
    """``until`` set while item ``hangs_at`` never comes (a read that hangs): next() ends, the
    items of the step begun (2 a step here) are given back, and a new pipeline resumed from
    the state goes on at the step's first item."""
    def hang(x):
        if x == hangs_at:
            threading.Event().wait()  # (in the child: until it is killed)
        return x

    until = threading.Event()
    p = Prefetch(Map(Sequence(range(20)), hang), 3, every=2, until=until)
    assert [next(p) for _ in range(hangs_at)] == list(range(hangs_at))
    until.set()
    with pytest.raises(StopIteration):
        next(p)
    assert p.interrupted and next(p, None) is None
    state = p.state_dict()
    p.close()
    resumed = Prefetch(Map(Sequence(range(20)), int), 3, every=2)  # (a server back up)
    resumed.load_state_dict(state)
    assert next(resumed) == hangs_at - hangs_at % 2
    resumed.close()


@pytest.mark.parametrize("every", [1, 2, 3])
def test_a_prefetch_cut_anywhere_in_a_step_resumes_at_the_next_item(every):
    """The child tells a step's items in one message; a state taken after any number of them
    (mid-step, some of the message's items not yet taken) resumes at the next item: the items
    are the upstream's, in order, each once."""
    items = [{"input_ids": torch.full((2, 3), i), "mask": torch.arange(5) % (i + 2) == 0, "i": i}
             for i in range(3 * every + 4)]
    for cut in range(1, 2 * every + 2):
        out = run_with_cuts(lambda: Prefetch(Sequence(items), 2 * every + 1, every=every), [cut],
                            len(items))
        assert out == [comparable(item) for item in items], cut


def test_a_pinned_buffer_is_written_again_only_once_its_copy_to_the_gpu_has_run(monkeypatch):
    """With pin_memory, items' tensors are views of pinned buffers kept from step to step (two
    steps of them). The consumer issues a step's copies to the GPU before it takes the next
    step's first item (as train_llm does), and the event recorded then is waited for before a
    buffer of the step before is written again. Faked here: pinning, and the event, which
    counts the copies issued when it was recorded."""
    copies = []  # the items whose copies were issued, in order

    class Event:
        recorded = waited = 0

        def record(self):
            self.recorded = len(copies)

        def synchronize(self):
            self.waited = self.recorded

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    every = 3
    batches = [{"input_ids": torch.full((4, 8), i), "labels": torch.full((4, 8), -i), "i": i}
               for i in range(10 * every)]
    p = Prefetch(Sequence(batches), 2 * every + 1, every=every, pin_memory=True)
    last_in = {}  # a buffer's address -> the last item handed out in it
    for _ in range(10):
        step = [next(p) for _ in range(every)]
        for item in step:
            at = item["input_ids"].data_ptr()
            assert last_in.get(at, -1) < p._copied.waited, "written before its copy ran"
            last_in[at] = item["i"]
        for item in step:  # (the step's copies: the items as the upstream made them)
            assert comparable(item) == comparable(batches[item["i"]])
            copies.append(item["i"])
    assert len(last_in) == 2 * every  # the same buffers, step after step
    p.close()


@pytest.mark.slow
def test_abandoned_pipeline_does_not_hang_exit(tmp_path):
    """A pipeline with background threads, dropped without close(), must let Python exit."""
    shard = write_jsonl(tmp_path / "a.jsonl", [{"text": "a b c " * 50}] * 200)
    script = textwrap.dedent(f"""
        import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from helpers import toy_tokenizer
        from data import Files, Tokenize, ConcatChunk, Prefetch
        tok = toy_tokenizer()
        p = Prefetch(ConcatChunk(Tokenize(Files({shard!r}, repeat=True), tok, num_threads=2), 8))
        next(p)
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


# -- bad input (DESIGN.md section 5) ---------------------------------------------------------------

@pytest.mark.parametrize("line, problem", [
    (b'{"text": "unterminated', "JSONDecodeError"),
    (b'["a", "list"]', "expected a JSON object, got list"),
    (b'{"content": "no text"}', "missing or null field(s) ['text']; it has ['content']"),
    (b'{"text": null, "id": 3}', "missing or null field(s) ['text']; it has ['id']"),
    (b'{"text": "\xff\xfe bad utf-8"}', "UnicodeDecodeError"),
])
def test_bad_record_names_shard_and_line(tmp_path, caplog, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok 1"}\n{"text": "ok 2"}\n' + line + b'\n{"text": "ok 4"}\n')
    files = Files(str(path), required_fields=["text"])
    assert texts(Count(files, 2)) == ["ok 1", "ok 2"]
    with pytest.raises(ValueError) as err:
        next(files)
    assert f"shard {path}, line 3" in str(err.value) and problem in str(err.value)

    files = Files(str(path), required_fields=["text"], skip_bad_records=True)
    with caplog.at_level(logging.WARNING, logger="data"):
        assert texts(files) == ["ok 1", "ok 2", "ok 4"]
    assert files.state_dict()["skipped"] == 1
    assert f"shard {path}, line 3" in caplog.text


def test_a_missing_shard_is_refused_by_name_when_its_turn_comes(tmp_path):
    files = Files([write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}]), str(tmp_path / "b.jsonl")])
    assert next(files)["text"] == "a"
    with pytest.raises(FileNotFoundError, match="b.jsonl does not exist"):
        next(files)


def test_a_truncated_gzip_shard_fails_naming_the_shard_and_the_last_line_read(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    write_jsonl(path, [{"text": f"record {i} " + "x" * 50} for i in range(2000)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match=r"cut.jsonl.gz: read failed after line \d+"):
        list(Files(str(path)))


def test_state_from_other_arguments_is_refused(tmp_path, toy):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a b"}] * 5)
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "a b"}] * 5)

    def build(urls=a, length=4, seed=0):
        return Shuffle(ConcatChunk(Tokenize(Files(urls), toy), length), 4, seed=seed)

    state = build().state_dict()
    build().load_state_dict(state)  # same arguments: fine
    with pytest.raises(ValueError, match="length=4.*length=8"):
        build(length=8).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        build(seed=1).load_state_dict(state)
    with pytest.raises(FilesChanged, match=r"1 then, 2 now; new: .*b\.jsonl"):
        build(urls=[a, b]).load_state_dict(state)  # said as a change in the files
    other_tok = toy_tokenizer()
    other_tok.name_or_path = "other"
    with pytest.raises(ValueError, match="tokenizer='toy'"):
        Shuffle(ConcatChunk(Tokenize(Files(a), other_tok), 4), 4).load_state_dict(state)


def test_files_empty_shards_are_skipped_not_fatal(tmp_path):
    empty = [write_jsonl(tmp_path / f"e{i}.jsonl", []) for i in range(3)]
    full = write_jsonl(tmp_path / "full.jsonl", [{"text": "x"}])
    assert texts(Files(empty)) == []
    for active in (1, 2, 3):  # several empty shards before the one with data, every epoch
        files = Files(empty + [full], repeat=True, shuffle_shards=True, n_active_shards=active)
        assert [next(files)["text"] for _ in range(5)] == ["x"] * 5
    # Without shuffle, slot 0 of 2 only ever meets shard 0 (empty): it is dropped, not spun on.
    files = Files(empty[:1] + [full], repeat=True, n_active_shards=2)
    assert [next(files)["text"] for _ in range(5)] == ["x"] * 5
    # Shards of blank lines or skipped bad records are as empty as empty files.
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"2 shard\(s\) hold no records but the 1 skipped "
                       r"as bad \(--skip-bad-records\)"):
        next(Files([str(blank), str(bad)], repeat=True, skip_bad_records=True))


def test_corrupt_zstd_names_the_shard(tmp_path):
    path = tmp_path / "bad.jsonl.zst"
    write_jsonl(path, [{"text": f"record {i}"} for i in range(100)])
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = b"\x00" * (len(data) - len(data) // 2)
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match=r"bad.jsonl.zst: read failed after line \d+"):
        list(Files(str(path)))


# -- Pad and Pack (fine-tuning) -----------------------------------------------------------------

def test_pad_masks_the_padding_and_refuses_or_truncates_a_sample_too_long():
    src = Sequence([{"input_ids": [5, 6, 7]},
                    {"input_ids": [5, 6], "labels": [-100, 6]}])  # a masked prompt token
    out = [{k: v.tolist() for k, v in s.items()} for s in Pad(src, 4, pad_id=1)]
    assert out == [
        {"input_ids": [5, 6, 7, 1], "attention_mask": [1, 1, 1, 0], "labels": [5, 6, 7, -100]},
        {"input_ids": [5, 6, 1, 1], "attention_mask": [1, 1, 0, 0],
         "labels": [-100, 6, -100, -100]}]
    with pytest.raises(ValueError, match="3 tokens is longer than length=2"):
        next(Pad(Sequence([{"input_ids": [5, 6, 7]}]), 2, pad_id=1))
    cut = next(Pad(Sequence([{"input_ids": [5, 6, 7]}]), 2, pad_id=1, truncate=True))
    assert cut["input_ids"].tolist() == [5, 6] and cut["labels"].tolist() == [5, 6]


def test_pack_restarts_positions_per_sample_and_truncates_or_drops_long_ones():
    src = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]},
           {"input_ids": [6, 7, 8, 9]}, {"input_ids": [10, 11, 12, 13, 14, 15, 16]},
           {"input_ids": [17]}]
    out = [{k: v.tolist() for k, v in s.items()} for s in Pack(Sequence(src), 6, pad_id=0)]
    assert out == [
        {"input_ids": [1, 2, 3, 4, 5, 0], "labels": [-100, 2, 3, -100, 5, -100],
         "position_ids": [0, 1, 2, 0, 1, 0], "attention_mask": [1, 1, 1, 1, 1, 0]},
        {"input_ids": [6, 7, 8, 9, 0, 0], "labels": [-100, 7, 8, 9, -100, -100],
         "position_ids": [0, 1, 2, 3, 0, 0], "attention_mask": [1, 1, 1, 1, 0, 0]},
        {"input_ids": [10, 11, 12, 13, 14, 15], "labels": [-100, 11, 12, 13, 14, 15],
         "position_ids": [0, 1, 2, 3, 4, 5], "attention_mask": [1, 1, 1, 1, 1, 1]},  # truncated
        {"input_ids": [17, 0, 0, 0, 0, 0], "labels": [-100, -100, -100, -100, -100, -100],
         "position_ids": [0, 0, 0, 0, 0, 0], "attention_mask": [1, 0, 0, 0, 0, 0]}]
    dropped = Pack(Sequence(src), 6, discard_long=True)
    assert [s["input_ids"].tolist() for s in dropped] == [[1, 2, 3, 4, 5, 0],
                                                          [6, 7, 8, 9, 17, 0]]
    assert dropped.state_dict()["discarded"] == 1


@pytest.mark.parametrize("make", [ConcatChunk, Chunk])
def test_a_negative_token_id_is_refused_naming_the_stage(make):
    """(Labels' -100 belong in "labels": ids index the vocabulary, and on a GPU an index
    below 0 fails far from here, in the embedding, without a name.)"""
    with pytest.raises(ValueError, match=rf"^{make.__name__}: input_ids hold an id below 0 .*"
                                         r"\(from -100 to 4\)"):
        next(make(Sequence([{"input_ids": [1, 2, -100, 3, 4]}]), 2))


class Dropping(Filter):
    """A learner's filter whose count of dropped samples is one field of its state."""

    def __init__(self, src, fn):
        super().__init__(src, fn)
        self.dropped = 0

    def __next__(self):
        while not self.fn(sample := next(self.src)):
            self.dropped += 1
        return sample

    def state_dict(self):
        return self._state(counters={"dropped": self.dropped})

    def load_state_dict(self, state):
        self._load(state)
        self.dropped = state["counters"]["dropped"]


def test_a_stages_own_counter_reaches_the_loop_with_each_item():
    """A stage's `counters` state field arrives with each item Prefetch hands out (as Files'
    bad records do, as "skipped"): the count as of that item, summed over the stages."""
    p = Prefetch(Dropping(Sequence(range(30)), lambda x: x % 3), depth=3)
    taken = [(next(p), dict(p.counters)) for _ in range(6)]
    p.close()
    assert [x for x, _ in taken] == [1, 2, 4, 5, 7, 8]
    assert [c["dropped"] for _, c in taken] == [1, 1, 2, 2, 3, 3]  # 0, 3, 6 dropped so far
    assert all(c["skipped"] == 0 for _, c in taken)


def test_a_save_after_a_signal_does_not_wait_for_a_hung_read():
    """``until`` set while the trainer still holds items and the child's read of the next one
    hangs: state_dict() answers at once (the child drops the read), and its state resumes
    at the first item not taken."""
    def hang(x):
        if x == 3:
            threading.Event().wait()  # (in the child: until it is killed)
        return x

    until = threading.Event()
    p = Prefetch(Map(Sequence(range(20)), hang), 3, until=until)
    assert [next(p), next(p)] == [0, 1]  # (2 is made; 3 hangs)
    until.set()
    saved = []
    saving = threading.Thread(target=lambda: saved.append(p.state_dict()), daemon=True)
    saving.start()
    saving.join(timeout=60)  # (a bound on a failure, not a wait for success)
    p.close()
    assert saved, "state_dict() waited for the hung read"
    resumed = Prefetch(Map(Sequence(range(20)), int), 3)
    resumed.load_state_dict(saved[0])
    assert next(resumed) == 2
    resumed.close()
