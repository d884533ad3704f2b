"""A checkpointable data pipeline for LLM training, one small class per stage.

Every stage is an iterator over samples (dicts) that wraps an upstream stage and obeys one
contract (DESIGN.md section 2): after ``s = stage.state_dict()``, a freshly built pipeline with
the same arguments that calls ``load_state_dict(s)`` yields exactly the items the original
would have yielded next. States are plain JSON. Sources resume by seeking, never by replaying.
A pipeline of them: README.md, "Using data.py on its own"; train_llm.py's is build_pipeline.

The file reads top to bottom in the order a sample meets the stages, a banner per section.
"""

import array
import collections
import concurrent.futures
import contextlib
import copy
import ctypes
import functools
import gc
import glob
import io
import itertools
import json
import logging
import math
import mmap
import multiprocessing
import os
import pickle
import random
import re
import select
import signal
import sys
import threading
import time
import traceback
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import braceexpand
import numpy as np
import smart_open
import torch

log = logging.getLogger("data")
# Tokenize's threads run the tokenizer: its own pool stays off (DESIGN.md section 6).
os.environ["TOKENIZERS_PARALLELISM"] = "false"


# --- The stage protocol (DESIGN.md section 2) -----------------------------------------------------

class Stage:
    """What every stage shares: iteration, close(), no state, the config check (DESIGN.md 2)."""

    src = None
    config = {}

    def __iter__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *error):
        self.close()

    def state_dict(self):
        return self._state()

    def load_state_dict(self, state):
        self._load(state)

    def reshard_state(self, olds, ctx):
        """This rank's state from ``olds``, the old ranks' (DESIGN.md section 4): stateless here."""
        if self.src is None or {key for old in olds for key in old} - {"config", "upstream"}:
            raise ValueError(f"reshard: the state of {type(self).__name__} cannot be split "
                             "across ranks")
        return self._state(upstream=self._reshard_upstream(olds, ctx))

    def close(self):
        """Stop background work here and upstream (all of a Mix's). Safe to call twice."""
        for upstream in getattr(self, "pipelines", [self.src]):
            if upstream is not None:
                upstream.close()

    def _check_config(self, saved, ignore=()):
        for key in sorted(set(saved) | set(self.config)):
            if key not in ignore and saved.get(key) != self.config.get(key):
                raise ConfigMismatch(
                    f"{type(self).__name__}: the saved state was made with {key}="
                    f"{saved.get(key)!r}, but this pipeline has {key}={self.config.get(key)!r}. "
                    "Resume with the arguments of the run that saved it.")

    def _state(self, **fields):
        """The config, the stage's own ``fields``, the upstream's (DESIGN.md section 2, rule 6)."""
        state = {"config": self.config, **fields}
        if self.src is not None and "upstream" not in state:
            state["upstream"] = self.src.state_dict()
        return state

    def _load(self, state):
        """Checks the config and loads the upstream state; the stage loads its own fields."""
        self._check_config(state.get("config", {}))
        if self.src is not None:
            self.src.load_state_dict(state["upstream"])

    def _reshard_upstream(self, olds, ctx):
        """The upstream's state on this rank, merged from the old ranks' (for reshard_state)."""
        return ctx.merge(self.src, [old["upstream"] for old in olds])


class DataError(ValueError):
    """Bad input: the message names the shard (or dataset) and where in it."""


class ConfigMismatch(ValueError):
    """A saved state made by a pipeline built with other arguments (see Stage._check_config)."""


class BadRecord(ValueError):
    """A record that does not parse or lacks what is required (Files: skip_bad_records)."""


class FilesChanged(ConfigMismatch):
    """A saved state of Files whose shards are not those it read, or not of the same sizes."""


def _rng_to_json(rng):
    """A random.Random's state as JSON-able lists (not utils.rng_state: a checkpoint's RNGs)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_json(rng, state):
    """Sets a random.Random to a state that _rng_to_json made; returns it."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))
    return rng


# --- Sources: Files (its readers and retries follow it), HFDataset --------------------------------

_COMPRESSED = (".gz", ".zst", ".bz2", ".xz")  # smart_open decompresses these by their suffix
_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
            ".txt": "text", ".bin": "tokens", ".npy": "tokens", ".cbor": "cbor"}
TOKEN_FORMATS = ("nanogpt", "llmc", "npy")  # token files' layouts (section 10), for format=


def shard_format(url):
    """A shard's format by its name: "jsonl", "parquet", "text", "tokens", "cbor", else None."""
    name = url.split("?")[0]
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    return _FORMATS.get(os.path.splitext(name)[1])


def expand_urls(urls):
    """Brace patterns, local globs and directories -> a list of URLs, each once (DESIGN.md 10)."""
    out = []
    for pattern in [urls] if isinstance(urls, str) else urls:
        literal = "://" not in pattern and os.path.isfile(pattern)
        for url in [pattern] if literal else braceexpand.braceexpand(pattern):
            local = "://" not in url
            if local and os.path.isdir(url):
                found = sorted(p for p in glob.glob(os.path.join(url, "**", "*"), recursive=True)
                               if os.path.isfile(p) and shard_format(p))
                # .txt files beside JSON or Parquet shards are notes, not data.
                if any(shard_format(p) != "text" for p in found):
                    found = [p for p in found if shard_format(p) != "text"]
            elif local and glob.has_magic(url) and not os.path.exists(url):
                found = sorted(glob.glob(url))
            else:
                found = [url]
            if not found or not local and re.search(r"[*\[]", url.split("?")[0].split("/", 3)[-1]):
                raise FileNotFoundError(f"no files match {url!r}" + ("" if local else (
                    ": remote paths are not globbed; name shards with {a,b} or {000..127}")))
            if odd := [p for p in found if "://" not in p and os.path.exists(p)
                       and not os.path.isfile(p)]:  # a FIFO would block, /dev/zero never end
                raise DataError(f"shard {odd[0]}: not a regular file (a pipe, a device or a "
                                "socket): shards are files that can be measured and seeked")
            out.extend(found)
    return list(dict.fromkeys(out))  # overlapping patterns name a shard once


class SplitError(ValueError):
    """The shards cannot be cut into a split for every slot (see Shards.plan)."""

    def __init__(self, message, n_splits):
        super().__init__(message)
        self.n_splits = n_splits


_OPENING = threading.Lock()  # an S3 open makes a boto3 client, not thread-safe (standby shards)


class Shards:
    """A Files' shards: kinds, opening, splits (DESIGN.md 4), records (its caches: never saved)."""

    def __init__(self, urls, *, format=None, transport_params=None, retry=None,
                 required_fields=(), tokenizer=None):
        self.urls, self.format = urls, format
        self.transport_params, self.retry = transport_params, retry
        self.required_fields = tuple(required_fields)
        self.tokenizer = tokenizer  # a token file's EOS and vocabulary
        self._kinds, self._arrays, self._bases, self._layouts = {}, {}, {}, {}

    def split(self, n_slots, world_size):
        """(plan, the input splits (url, start, end)): at least one a slot, or SplitError."""
        plan = self.plan(n_slots)
        cuts = plan or [[None, 1]] * len(self.urls)  # (no plan: every shard whole)
        splits = [(url, units * j // n, units * (j + 1) // n) if units is not None
                  else (url, 0, None) for url, (units, n) in zip(self.urls, cuts)
                  for j in range(n)]  # (n contiguous ranges; a shard without units: 1)
        if len(splits) < n_slots:
            raise self.too_few_splits(len(splits), n_slots, world_size)
        return plan, splits

    def start(self, url, start):
        """Where the first record of a split that begins at ``start`` is, as a slot holds it."""
        return {"parquet": {"row_group": start, "row": 0}, "array": {"index": start},
                "tokens": {"token": start}}.get(self.kind(url), {"offset": start})

    def too_few_splits(self, n, n_slots, world_size):
        """The SplitError for shards cut into only ``n`` splits, fewer than ``n_slots``."""
        most = n // world_size * world_size
        fix = (f"pass n_active_shards={most} (train_llm.py: --active-shards {most}), a multiple "
               f"of the world size {world_size} no larger than {n}" if most else
               f"that is fewer than the {world_size} ranks: store the data as plain JSON Lines "
               "(cut at any line), or in more shards or Parquet row groups")
        return SplitError(
            f"{len(self.urls)} shard(s) can be cut into only {n} input split(s) (a compressed "
            "JSON Lines shard cannot be cut, a Parquet shard only between row groups), fewer "
            f"than the n_active_shards={n_slots} slots that must each read one; {fix}.", n)

    def keep_arrays(self, urls):
        """A JSON array's records are held only while a slot reads it."""
        self._arrays = {url: records for url, records in self._arrays.items() if url in urls}

    def plan(self, n_slots):
        """None (a split per shard), or [units, splits] per shard: n_slots splits (DESIGN.md 4)."""
        if len(self.urls) >= n_slots:
            return None
        sizes, units, caps = zip(*(self.measure(url) for url in self.urls))
        counts = [1] * len(self.urls)
        for _ in range(n_slots - len(self.urls)):  # D'Hondt: to the largest splits' shard
            growable = [i for i in range(len(counts)) if counts[i] < caps[i]]
            if not growable:
                break
            counts[max(growable, key=lambda i: sizes[i] / counts[i])] += 1
        return [[u, n] for u, n in zip(units, counts)]

    def measure(self, url):
        """(bytes, units to cut into or None, most splits) of a shard; some splits may be empty."""
        kind = self.kind(url)  # (it retries on its own: not inside the retries below)

        def attempt():
            if kind == "parquet":
                with self.open(url) as f:
                    groups = _parquet_file(f, url, self.required_fields).num_row_groups
                    return f.seek(0, os.SEEK_END), groups, max(1, groups)
            if "://" in url:
                with self.open(url) as f:
                    size = f.seek(0, os.SEEK_END)
            else:
                size = os.path.getsize(url)
            if kind == "array":
                return size, len(self.array(url)), math.inf
            if kind == "tokens":
                return size, self.tokens(url)[2], math.inf
            return (size, None, 1) if url.endswith(_COMPRESSED) or kind == "cbor" else (
                size, size, math.inf)
        return self.retry.run(url, "its size", attempt)

    def open(self, url, at=0):
        """The shard for bytes, from byte ``at``: one request there on S3 and HTTP, no seek."""
        params = _merged(_one_owner(url), self.transport_params or {})
        http = url.startswith(("http://", "https://"))
        if http and at:  # (positions then count from ``at``: such a shard is only read on)
            params["headers"] = {"Accept-Encoding": "identity", **params.get("headers", {}),
                                 "Range": f"bytes={at}-"}
        with _OPENING if url.startswith("s3://") else contextlib.nullcontext():
            f = smart_open.open(url, "rb", transport_params=params)
        if http and at:  # the rest of the shard in one answer, or smart_open's seek gets it
            status, answer = f.response.status_code, f.response.headers.get("Content-Range", "")
            span = re.fullmatch(rf"bytes {at}-(\d+)/(\d+)", answer)
            if status == 206 and span and int(span[1]) + 1 == int(span[2]):
                return f
            f.close()
            if status == 200:
                raise OSError("the server ignored the range request")  # (see _permanent)
            del params["headers"]["Range"]  # (a range cut short: ask as smart_open asks)
            f = smart_open.open(url, "rb", transport_params=params)
        if at:
            f.seek(at)
        return f

    def kind(self, url):
        """"parquet", "text", "jsonl", "tokens", "cbor", or "array" (a .json of one array)."""
        if (kind := self._kinds.get(url)) is not None:  # asked for every record: cached
            return kind
        if (kind := self.format or shard_format(url)) in ("parquet", "text", "tokens", "cbor",
                                                          *TOKEN_FORMATS):
            self._kinds[url] = "tokens" if kind in TOKEN_FORMATS else kind
            if self._kinds[url] == "tokens":  # its header too, as a JSON array's first byte
                self.tokens(url)
        else:
            name = url.split("?")[0]
            for suffix in _COMPRESSED:
                name = name.removesuffix(suffix)
            array = self.format is None and name.endswith(".json") and self.retry.run(
                url, "its first byte", lambda: _first_byte(url, self.open) == b"[")
            self._kinds[url] = "array" if array else "jsonl"
        return self._kinds[url]

    def array(self, url):
        """A JSON-array shard's records, parsed whole once, shared by its splits while read."""
        if url not in self._arrays:
            with self.open(url) as f:
                try:
                    self._arrays[url] = json.load(f)
                except ValueError as e:
                    raise DataError(f"shard {url}: not valid JSON: {e}") from e
        return self._arrays[url]

    def tokens(self, url):
        """(bytes before the ids, their dtype, how many) of a token file (token_layout)."""
        if url not in self._layouts:
            def attempt():
                with self.open(url) as f:
                    return f.read(1024), f.seek(0, os.SEEK_END)
            head, size = self.retry.run(url, "its header", attempt)
            self._layouts[url] = token_layout(url, head, size, self.format)
        return self._layouts[url]

    def reader(self, slot):
        """(line or record, where the next one starts) of the slot's split, from a copy of it."""
        slot, kind = _saved(slot), self.kind(slot["url"])
        if kind == "parquet":
            return _read_row_groups(slot, self.open, self.required_fields)
        if kind == "array":
            return _read_array(slot, self.array(slot["url"]))
        if kind == "tokens":
            return _read_tokens(slot, self.open, self.tokens(slot["url"]), self.tokenizer)
        if kind == "cbor":
            return _read_cbor(slot, self.open)
        return _read_lines(slot, self.open)  # JSON Lines and text: lines

    def record(self, data, slot, check):
        """The record in what a reader gave (None: a blank line), checked (DESIGN.md 5)."""
        kind, where = self.kind(slot["url"]), f"shard {slot['url']}"
        if kind == "tokens":  # ids, checked by their reader
            return data
        if kind in ("jsonl", "text") and data.isspace():
            return None
        try:
            return _parse(data, kind, self.required_fields, check)
        except DataError as e:  # no bad record but data the pipeline cannot use: not skipped
            raise DataError(f"{where}, {self.position(slot)}: {e}") from e
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are both
            if kind == "jsonl" and not data.endswith(b"\n"):  # not a record yet: not skipped
                raise DataError(f"{where}, {self.position(slot)}: its last line has no newline "
                                "and is no whole record: the file is still being written, or "
                                "was cut short; rerun once it is whole, or mend its end") from e
            raise BadRecord(f"{where}, {self.position(slot)}: bad record: "
                            f"{type(e).__name__}: {e}") from e

    def position(self, slot):
        """The line (row, record) the slot read last, counted from the shard's start, once."""
        url, start = slot["url"], slot["start"]
        if "index" in slot or "token" in slot or "last_at" in slot:
            return (f"token {slot['token']}" if "token" in slot else
                    f"record {slot.get('index', slot['line'])}")
        if start and (url, start) not in self._bases:
            count = functools.partial(_lines_before, slot, self.open, self.required_fields)
            self._bases[url, start] = self.retry.run(url, "counting lines", count)
        line = self._bases.get((url, start), 0) + slot["line"]
        return f"row {line}" if "row_group" in slot else f"line {line}"


class Files(Stage):
    """Shards read round-robin by ``n_active_shards`` slots (DESIGN.md sections 4, 5 and 10)."""

    def __init__(self, urls, *, repeat=False, epochs=None, shuffle_shards=False, seed=0,
                 n_active_shards=1, skip_bad_records=False, required_fields=(), check=None,
                 format=None, transport_params=None, retries=8, retry_delay=1.0, rank=0,
                 world_size=1, tokenizer=None, n_standby_shards=0, n_prefetch_samples=10,
                 standby_timeout=60.0):
        if n_active_shards < 1 or n_active_shards % world_size:
            raise ValueError(f"n_active_shards={n_active_shards} must be a positive multiple "
                             f"of world_size={world_size}, so every rank reads whole slots")
        self.urls = expand_urls(urls)
        _check_formats(self.urls, format)
        self.repeat, self.shuffle_shards, self.seed = repeat, shuffle_shards, seed
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs={epochs}: pass at least 1, or None for endless")
        self.epochs = epochs if repeat else 1  # passes over the shards; None: endless
        self.n_slots = n_active_shards
        self.skip_bad_records, self.check = skip_bad_records, check
        self._retry = _Retry(retries, retry_delay)
        self.shards = Shards(self.urls, format=format, transport_params=transport_params,
                             retry=self._retry, required_fields=required_fields,
                             tokenizer=tokenizer)
        self._empty = set()  # splits that own no line: passed unopened later (never saved)
        self.plan, self.splits = self.shards.split(n_active_shards, world_size)
        self._order = (None, None)  # (epoch, split order) of the last split opened
        self.config = {"urls": self.urls, "repeat": repeat, "epochs": self.epochs,
                       "shuffle_shards": shuffle_shards, "seed": seed,
                       "n_active_shards": n_active_shards, "rank": rank,
                       "world_size": world_size, "format": format, "split_plan": self.plan}
        # The open slots: "pos" in the endless sequence of splits (DESIGN.md section 2, Files)
        self.slots = [slot for s in range(rank, n_active_shards, world_size)
                      if (slot := self._slot(s)) is not None]
        self.turn = 0         # which slot gives the next record
        self.skipped = 0      # bad records skipped (only with skip_bad_records)
        self._files = [None] * len(self.slots)  # readers of the open splits; never in the state
        self._rank_splits = None  # the splits this rank can be given (endless: see __next__)
        self._reading = self.epoch
        self._saved = {}  # pos -> the saved form of that slot while it reads nothing new
        self._standby = _Standby(self, n_standby_shards, n_prefetch_samples, standby_timeout)

    # -- splits ----------------------------------------------------------------------------

    def _slot(self, pos):
        """A new slot reading the split at position ``pos``, or None past a finite end."""
        epoch, i = divmod(pos, len(self.splits))
        if self.epochs is not None and epoch >= self.epochs:
            return None
        if self._order[0] != epoch:  # derived from (seed, epoch), so never saved
            self._order = (epoch, _split_order(len(self.splits), self.seed, epoch,
                                               self.shuffle_shards))
        url, start, end = self.splits[self._order[1][i]]
        return {"pos": pos, "url": url, "start": start, "end": end,
                **self.shards.start(url, start), "line": 0, "records": 0}

    @property
    def epoch(self):
        """The oldest epoch still being read."""
        return min((s["pos"] // len(self.splits) for s in self.slots), default=0)

    # -- the round-robin -------------------------------------------------------------------

    def __next__(self):
        empties = set()  # splits met empty since the last record: all of them means none
        current = self._reading  # the epoch this rank reads (self.epoch, kept up to date)
        if self._standby.fresh:
            self._standby.plan()
        while self.slots:
            self.turn %= len(self.slots)
            if self.slots[self.turn]["pos"] // len(self.splits) > current:
                self.turn += 1  # done with this epoch: it waits until every slot is
                continue
            if (record := self._read(self.turn)) is not None:
                self.turn += 1
                return record
            if (empty := self._next_split(self.turn)) is not None:
                empties.add(empty)
            current = self._reading = self.epoch
            if self.epochs is None and empties:
                self._rank_splits = self._rank_splits or _rank_splits(
                    self.splits, self.slots, self.n_slots, self.shuffle_shards)
                if empties >= self._rank_splits:
                    break  # endless, and every split this rank can read is empty
        if self.epochs is None:
            raise _nothing_to_read(self.config, self.skipped)
        raise StopIteration

    def _next_split(self, i):
        """Slot i moves on to its next split, or closes; the split if it held no records."""
        done, empty = self.slots[i], None
        if self._files[i] is not None:  # (None: a split known to be empty was not opened)
            self._files[i].close()
            self._files[i] = None
        split = (done["url"], done["start"], done["end"])
        if done["records"] == 0:
            empty = split
            if (self.plan is None or done["end"] is None) and split not in self._empty:
                log.warning("shard %s has no records", done["url"])  # a whole shard
        if done["line"] == 0:
            self._empty.add(split)
        following = self._slot(done["pos"] + self.n_slots)
        if following is None:  # this slot has no splits left
            self.slots.pop(i)
            self._files.pop(i)
        else:
            self.slots[i] = following
            self._files[i] = self._standby.take(following)
        self.shards.keep_arrays({slot["url"] for slot in self.slots})
        return empty

    def _read(self, i):
        """The next record of slot i, or None at the end of its split."""
        slot = self.slots[i]
        if slot["line"] == 0 and (slot["url"], slot["start"], slot["end"]) in self._empty:
            # (As 7 of 8 splits of one long line: reopened, each read the line's rest every epoch.)
            return None
        self.shards.kind(slot["url"])  # known before the retries, which must not nest
        while (item := self._retry.next(self._files, i, slot, self.shards.reader)) is not None:
            data, where = item
            slot.update(where)
            self._saved.pop(slot["pos"], None)
            try:
                record = self.shards.record(data, slot, self.check)
            except BadRecord as e:
                if not self.skip_bad_records:
                    raise DataError(f"{e} (skip_bad_records=True, train_llm.py "
                                    "--skip-bad-records, skips such records)") from e
                self.skipped += 1
                log.warning("skipped (%d so far): %s", self.skipped, e)
                continue
            if record is not None:  # (None: a blank line, no record)
                slot["records"] += 1
                return record
        return None

    # -- state -----------------------------------------------------------------------------

    def _check_config(self, saved, ignore=()):
        """The arguments, then the files: a change in the files is said as such."""
        super()._check_config(saved, ignore=(*ignore, "urls", "split_plan"))
        _check_files(saved.get("urls", []), saved.get("split_plan"), self.urls, self.plan)

    def state_dict(self):
        self._saved = {s["pos"]: self._saved.get(s["pos"]) or _saved(s) for s in self.slots}
        return self._state(epoch=self._reading, turn=self.turn, skipped=self.skipped,
                           slots=list(self._saved.values()))

    def load_state_dict(self, state):
        self._load(state)
        self.close()
        self.turn, self.skipped = state["turn"], state["skipped"]
        # (States saved before splits existed read whole shards: start 0, no end.)
        self.slots = [{**s, "start": s.get("start", 0), "end": s.get("end")}
                      for s in state["slots"]]
        self._files = [None] * len(self.slots)  # opened (by seeking) on first read
        self._rank_splits, self._reading, self._saved = None, self.epoch, {}

    def close(self):
        for f in self._files:
            if f is not None:
                f.close()
        self._files = [None] * len(self.slots)
        self._standby.close()

    def reshard_state(self, olds, ctx):
        """The slots of every old rank: this rank takes those s = rank (mod world size)."""
        slots = {s["pos"] % self.n_slots: s for old in olds for s in old["slots"]}
        keep = sorted(s for s in slots if s % ctx.world_size == ctx.rank)
        # Where one old rank owned exactly these slots, its round-robin turn carries over.
        turns = [old["turn"] for old in olds
                 if [s["pos"] % self.n_slots for s in old["slots"]] == keep]
        return self._state(turn=turns[0] if turns else 0,
                           skipped=sum(old["skipped"] for old in olds) if ctx.rank == 0 else 0,
                           slots=[slots[s] for s in keep])


class _Standby:
    """The next ``n`` splits of Files, opened on threads (standby shards: DESIGN.md section 2)."""

    def __init__(self, files, n, n_prefetch, timeout):
        self.files, self.n, self.n_prefetch, self.timeout = files, n, n_prefetch, timeout
        self.pending, self._pool = {}, None  # pos -> future (records read, the reader)
        self.fresh = True  # nothing planned since the start (or a close)

    def _open(self, slot):
        reader = self.files.shards.reader(slot)
        return list(itertools.islice(reader, self.n_prefetch)), reader

    def plan(self):
        """Opens the next splits of the slots that have read longest, up to ``n`` at a time."""
        files, self.fresh = self.files, False
        for pos in sorted(s["pos"] + files.n_slots for s in files.slots)[:self.n]:
            if len(self.pending) < self.n and pos not in self.pending and (
                    slot := files._slot(pos)) is not None:
                self._pool = self._pool or ThreadPoolExecutor(self.n, "standby")
                self.pending[pos] = self._pool.submit(self._open, slot)

    def take(self, slot):
        """The reader of ``slot`` if it stands by within ``timeout``, else None (DESIGN.md 2)."""
        future, ready = self.pending.pop(slot["pos"], None), None
        try:
            ready = future and _chained(*future.result(self.timeout))
        except Exception:
            future.add_done_callback(_close_reader)
        self.plan()
        return ready

    def close(self):
        for future in self.pending.values():
            future.add_done_callback(_close_reader)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.pending, self.fresh, self._pool = {}, True, None


def _chained(records, reader):
    try:
        yield from records
        yield from reader
    finally:
        reader.close()


def _close_reader(future):
    if not future.cancelled() and future.exception() is None:
        future.result()[1].close()


def _check_files(old, old_plan, new, plan):
    """FilesChanged, saying what, if the shards (``new``, ``plan``) are not those of the state."""
    if old != new:
        added, gone = [u for u in new if u not in old], [u for u in old if u not in new]
        raise FilesChanged(
            f"the shards it matches are not those the state was saved with: {len(old)} "
            f"then, {len(new)} now" + (f"; new: {_few(added)}" if added else "") +
            (f"; gone: {_few(gone)}" if gone else "") +
            ("" if added or gone else "; the same ones in another order"))
    if old_plan != plan:
        plans = zip(new, old_plan or [None] * len(new), plan or [])
        raise FilesChanged(f"shard(s) {_few([u for u, a, b in plans if a != b])} changed size "
                           "since the state was saved (they are cut into splits by their sizes)")


def _split_order(n, seed, epoch, shuffled):
    """The order in which an epoch reads ``n`` splits: shuffled by (seed, epoch), or as is."""
    order = list(range(n))
    if shuffled:
        random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def _rank_splits(splits, slots, n_slots, shuffled):
    """The splits a rank's ``slots`` can ever be given: all if shuffled, else a fixed cycle."""
    if shuffled:
        return set(splits)
    return {splits[(slot["pos"] + k * n_slots) % len(splits)]
            for slot in slots for k in range(len(splits))}


def _nothing_to_read(config, skipped):
    """The error of an endless Files whose rank's splits hold no records."""
    rank, world, urls = config["rank"], config["world_size"], config["urls"]
    whose = f"rank {rank} of {world}: its splits of " if world > 1 else ""
    held = (f"hold no records but the {skipped} skipped as bad (--skip-bad-records)"
            if skipped else "hold no records")
    return DataError(f"{whose}{len(urls)} shard(s) {held}, so an endless stream would wait "
                     f"forever ({urls[:3]}...)")


def _few(urls):
    return ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")


def _saved(slot):
    """A slot as its state (and a reopened reader) holds it: the line read last as its crc32."""
    slot = dict(slot)
    if "_row" in slot:
        slot["last_row"] = _row_crc(slot.pop("_row"))
    if "_line" in slot:
        text = slot.pop("_line")
        slot["last"] = [len(text), zlib.crc32(text)]
    return slot


def _row_crc(record):
    return _crc(json.dumps(record, sort_keys=True, default=str))


def _check_formats(urls, format):
    """Refuses shards whose format Files cannot tell or read (a compressed Parquet), by name."""
    if format not in (None, "jsonl", "parquet", "text", "cbor", *TOKEN_FORMATS):
        raise ValueError(f"format={format!r}: pass 'jsonl', 'parquet', 'text', 'cbor', one of "
                         f"{TOKEN_FORMATS} or None (by suffix)")
    for url in urls:
        if (kind := format or shard_format(url)) is None:
            raise DataError(f"shard {url}: cannot tell its format from its name; Files reads "
                            f"{sorted(_FORMATS)} (JSON Lines optionally compressed "
                            f"{_COMPRESSED}). Name the format: format='jsonl', 'parquet' or "
                            "'text' (train_llm.py: --data-format jsonl|parquet|text). CSV is "
                            "not read: convert it to JSON Lines (one JSON object per line)")
        if kind in ("parquet", "tokens", "cbor", *TOKEN_FORMATS) and url.endswith(_COMPRESSED):
            raise DataError(f"shard {url}: a Parquet, CBOR or token file must be able to seek, so "
                            "it cannot be compressed as a whole")
    if format and (other := [u for u in urls if shard_format(u) not in (None, format)]):
        log.warning("format=%r (--data-format %s) reads %d shard(s) whose names say another "
                    "format as %s: %s", format, format, len(other), format, _few(other))


def _parse(data, kind, required_fields, check):
    """A checked record from what a reader gave (a line, a row, an element); bad: ValueError."""
    record = (_json_line(data) if kind == "jsonl" else
              {"text": data.decode().rstrip("\r\n").removeprefix("\ufeff")} if kind == "text"
              else data)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if required_fields and (missing := _missing(record, required_fields)):
        raise ValueError(f"missing or null field(s) {missing}; it has "
                         f"{sorted(k for k in record if record[k] is not None)}")
    if check is not None:
        check(record)
    return record


_JSON = json.JSONDecoder()


def _json_line(line):
    """json.loads(line) without its detection of the encoding every call (DESIGN.md section 6)."""
    if line.startswith(b"\xef\xbb\xbf") or b"\0" in line[:4]:
        return json.loads(line)
    return _JSON.decode(line.decode("utf-8", "surrogatepass"))


def _missing(record, fields):
    """The required fields a record lacks: absent, or null (JSON null, a Parquet null)."""
    return [k for k in fields if record.get(k) is None]


def _where(slot):
    """Where a slot is, cheaply: for retry messages."""
    if "row_group" in slot:
        return f"row group {slot['row_group']}, row {slot['row']}"
    if "index" in slot or "token" in slot:
        return f"record {slot['index']}" if "index" in slot else f"token {slot['token']}"
    return f"line {slot['line']}" if slot["start"] == 0 else f"byte {slot['offset']}"


# -- Files' readers: (line or record, where the next starts) of a split, from its slot's place --
MAX_LINE_BYTES = 256 << 20  # a longer line is refused unread (DESIGN.md section 5)


def _read_lines(slot, open_shard):
    """A JSON Lines (or text) split, from the slot's offset: the lines that start before its end."""
    url, offset, line = slot["url"], slot["offset"], slot["line"]
    end = math.inf if slot["end"] is None else slot["end"]
    # A split's lines start in it (DESIGN.md 4): from byte start - 1, skip to the next line start.
    skip = "last" not in slot and 0 < offset == slot["start"]
    # Read from the line read last (checked), the byte before a split's start, or the offset.
    at = offset - slot["last"][0] if "last" in slot else offset - skip
    compressed = url.endswith(_COMPRESSED)  # decompression cannot jump: re-read up to `at`
    with open_shard(url, 0 if compressed else at) as f:
        size = _check_size(f, slot)  # (checked on every reopen: DESIGN.md section 2, rule 2)
        if compressed and sum(len(chunk) for chunk in _chunks(f, at)) < at:
            raise DataError(f"shard {url} is shorter than the saved offset {at}")
        if "last" in slot:  # (states of older versions have no "last": not checked)
            # The line read last must be as it was: a same-size file with other lines must not
            # resume inside a line (equal bytes end in the newline it had, or at the file's end).
            length, crc = slot["last"]
            if zlib.crc32(b"".join(_chunks(f, length))) != crc:
                raise _changed_row(url, f"line that ended at byte {offset}")
        elif skip:
            crossing = f.readline(MAX_LINE_BYTES + 1)
            if len(crossing) > MAX_LINE_BYTES:
                raise DataError(f"shard {url}: the line across byte {offset} is longer than "
                                f"{MAX_LINE_BYTES:,} bytes (data.MAX_LINE_BYTES)")
            offset += len(crossing) - 1
        # The line read last ("_line") is a state's "last"; the first line records the size.
        first = {"size": size}
        while offset < end and (text := f.readline(MAX_LINE_BYTES + 1)):
            if len(text) > MAX_LINE_BYTES:  # read no further: it could be endless (/dev/zero)
                raise DataError(f"shard {url}: the line at byte {offset} is longer than "
                                f"{MAX_LINE_BYTES:,} bytes (data.MAX_LINE_BYTES): no document "
                                "is; is it a file without line breaks?")
            offset, line = offset + len(text), line + 1
            yield text, {"offset": offset, "line": line, "_line": text, **first}
            first = {}


def _check_size(f, slot):
    """A local shard's size, which must be the one the slot saw (if it saw one)."""
    size = os.fstat(f.fileno()).st_size if "://" not in slot["url"] else None
    if slot.get("size") not in (None, size):
        raise DataError(f"shard {slot['url']} changed since this run read it: {slot['size']} "
                        f"bytes then, {size} now. Resuming would read from the wrong places: "
                        "restore the file, or start a new run on the new data")
    return size


def _changed_row(url, where):
    return DataError(f"shard {url} changed since this run read it: its {where} is not the one "
                     "it read there (records added or edited before it). Resuming would read "
                     "from the wrong places: restore the file, or start a new run on the new data")


def _read_row_groups(slot, open_shard, required_fields):
    """A Parquet split, from the slot's row group and row: only the footer and those groups."""
    url, first = slot["url"], slot["row_group"]
    with open_shard(url) as f:
        size = _check_size(f, slot)  # (and the row read last, below: its crc)
        parquet = _parquet_file(f, url, required_fields)
        line, end = slot["line"], slot["end"]
        for group in range(first, parquet.num_row_groups if end is None else end):
            table = parquet.read_row_group(group)
            if group == first and slot["row"] and "last_row" in slot and _row_crc(
                    table.slice(slot["row"] - 1, 1).to_pylist()[0]) != slot["last_row"]:
                raise _changed_row(url, f"row {slot['row'] - 1} of row group {group}")
            for start in range(slot["row"] if group == first else 0,
                               table.num_rows, 1024):  # to Python 1024 rows at a time
                for row, record in enumerate(table.slice(start, 1024).to_pylist(), start):
                    line += 1
                    where = ((group, row + 1) if row + 1 < table.num_rows else (group + 1, 0))
                    yield record, {"row_group": where[0], "row": where[1], "line": line,
                                   "size": size, "_row": dict(record)}  # (a copy: stages add keys)


def _read_array(slot, records):
    """A JSON-array split, from the slot's index; ``records`` is the whole array."""
    end, first = len(records) if slot["end"] is None else slot["end"], slot["index"]
    if first and "last_row" in slot and (first > len(records) or _row_crc(
            records[first - 1]) != slot["last_row"]):
        raise _changed_row(slot["url"], f"record {first - 1}")
    for index in range(first, end):
        yield records[index], {"index": index + 1, "line": slot["line"] + index + 1 - first,
                               "_row": copy.copy(records[index])}


def _read_cbor(slot, open_shard):
    """A CBOR shard from the slot's offset, checking the record read last (DESIGN.md 2 and 10)."""
    import cbor2
    url, offset, line, at = slot["url"], slot["offset"], slot["line"], slot.get("last_at")
    with open_shard(url, offset if at is None else at) as f:
        # Positions count from where it opened; read as needed (cbor2 seeks back after read-ahead).
        first, decoder = {"size": _check_size(f, slot)}, cbor2.CBORDecoder(f, read_size=1)
        base = (offset if at is None else at) - f.tell()
        if at is not None and (_row_crc(decoder.decode()) != slot["last_row"]
                               or base + f.tell() != offset):
            raise _changed_row(url, f"record {line}")
        while True:
            try:
                record = decoder.decode()
            except cbor2.CBORDecodeEOF:
                if base + f.tell() == offset:  # (the end of the file, between two records)
                    return
                raise DataError(f"shard {url}: cut short inside record {line + 1}") from None
            except cbor2.CBORDecodeError as e:
                if is_transient(e):  # (a connection dropped inside a record: cbor2 wraps it)
                    raise
                raise DataError(f"shard {url}, record {line + 1}: not CBOR: {e}") from e
            line, at, offset = line + 1, offset, base + f.tell()
            yield record, {"offset": offset, "line": line, "last_at": at,
                           "_row": copy.copy(record), **first}
            first = {}


# -- Token files: nanoGPT's raw ids, llm.c's shards, .npy (DESIGN.md section 10) --------------
LLMC_HEADERS = {(20240520, 1): np.uint16, (20240801, 7): np.uint32}  # llm.c's (magic, version)
MAX_DOC_TOKENS = 1 << 24  # ids without an EOS that still make one document


def token_layout(url, head, size, format=None):
    """(bytes before the ids, their dtype, how many) of a token file, or refused (DESIGN.md 10)."""
    if format == "npy" or format is None and url.split("?")[0].endswith(".npy"):
        f = io.BytesIO(head)
        try:
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(f)]
            shape, _, dtype = read(f)
        except (ValueError, KeyError) as e:
            raise DataError(f"shard {url}: not a .npy file numpy can read ({e})") from e
        if len(shape) != 1 or dtype.kind not in "iu":
            raise DataError(f"shard {url}: a token file holds one row of integer ids, not "
                            f"{dtype} of shape {shape}")
        base, count, what = f.tell(), shape[0], "the .npy header says"
    else:
        magic, version, count = np.frombuffer(head[:12].ljust(12, b"\0"), "<i4").tolist()
        dtype = LLMC_HEADERS.get((magic, version))
        if format != "nanogpt" and (format == "llmc" or magic in {m for m, _ in LLMC_HEADERS}
                                    or len(head) == 1024 and not any(head[12:])):  # a header
            if dtype is None:
                raise DataError(f"shard {url}: no llm.c header it can read (magic {magic}, "
                                f"version {version}; known: {sorted(LLMC_HEADERS)})")
            base, what = 1024, "its llm.c header says"
        else:
            base, dtype, count, what = 0, np.uint16, size // 2, "nanoGPT's uint16 ids take"
        dtype = np.dtype(dtype).newbyteorder("<")
    if size != (whole := base + count * dtype.itemsize):
        raise DataError(f"shard {url}: {size:,} bytes, where {count:,} ids as {what} {whole:,}: "
                        "cut short (a write that did not finish: make it again), or another layout")
    return base, dtype, count


class _Ids:
    """The ids of a token file from token ``pos`` on, read 1M at a time as they are needed."""

    def __init__(self, f, dtype, pos, url):
        self.f, self.dtype, self.pos, self.url = f, dtype, pos, url
        self.ids, self.tail = np.zeros(0, dtype), b""  # tail: a read that ended inside an id

    def _more(self):
        data = self.tail + (chunk := self.f.read((1 << 20) * self.dtype.itemsize))
        n = len(data) - len(data) % self.dtype.itemsize
        self.ids = np.concatenate([self.ids, np.frombuffer(data[:n], self.dtype)])
        self.tail = data[n:]
        return bool(chunk)

    def until(self, value):
        """How many ids come before the next ``value`` (None: the file ends first), looked for
        in windows that double: a short document costs what it holds, not the buffer."""
        seen, window = 0, 256
        while not (hits := np.flatnonzero(self.ids[seen:seen + window] == value)).size:
            seen, window = min(seen + window, len(self.ids)), window * 2
            if seen == len(self.ids) and seen > MAX_DOC_TOKENS:
                raise DataError(f"shard {self.url}: no EOS (id {value}) in the {seen:,} ids from "
                                f"token {self.pos}: is --tokenizer the one that made the file?")
            if seen == len(self.ids) and not self._more():  # (all read: more, if any)
                return None
        return seen + int(hits[0])

    def take(self, n):
        """The next ``n`` ids (fewer at the file's end)."""
        while len(self.ids) < n and self._more():
            pass
        out, self.ids = self.ids[:n], self.ids[n:]
        self.pos += len(out)
        return out


def _read_tokens(slot, open_shard, layout, tokenizer):
    """A token-file split from the slot's token: the documents that start in it (DESIGN.md 10)."""
    url, (base, dtype, count) = slot["url"], layout
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise DataError(f"shard {url} is a token file: Files(tokenizer=...) gives its EOS")
    eos, vocab, line = tokenizer.eos_token_id, len(tokenizer), slot["line"]
    if base == 0 and vocab > 1 << 16:  # (nanoGPT's: uint16, which cannot hold such ids)
        raise DataError(f"shard {url}: raw uint16 ids, and the tokenizer has {vocab:,}")
    at, end = slot["token"], count if slot["end"] is None else min(slot["end"], count)
    before = slot["last"][0] // dtype.itemsize if "last" in slot else min(at, 1)  # (checked)
    with open_shard(url, base + (at - before) * dtype.itemsize) as f:
        first, ids = {"size": _check_size(f, slot)}, _Ids(f, dtype, at - before, url)
        seen = ids.take(before)
        if "last" in slot and zlib.crc32(seen) != slot["last"][1]:
            raise _changed_row(url, f"document that ended at token {at}")
        if not ("last" in slot or at == 0 or seen.tolist() == [eos]):  # inside a document
            n = ids.until(eos)  # (it belongs to the split before)
            ids.take(count if n is None else n + 1)
        while ids.pos < end:
            start, n = ids.pos, ids.until(eos)
            read = ids.take(count if n is None else n + 1)  # a view: the document, its EOS
            doc = read[:n]
            if doc.size and (doc.max() >= vocab or doc.min() < 0):
                bad = start + int(np.flatnonzero((doc >= vocab) | (doc < 0))[0])
                raise DataError(f"shard {url}, token {bad}: id {doc[bad - start]} is not one of "
                                f"the {vocab:,} ids of the tokenizer: pass the one that made it")
            if doc.size:  # (two EOS in a row: no document between them)
                line += 1
                yield {"input_ids": doc.tolist()}, {"token": ids.pos, "line": line,
                                                    "_line": memoryview(read).cast("B"),
                                                    **first}
                first = {}


def _parquet_file(f, url, required_fields):
    """An open Parquet shard, refused if it is not Parquet or lacks a required column."""
    import pyarrow.parquet  # here, not at the top: 60 MB of memory that JSONL runs go without
    try:
        parquet = pyarrow.parquet.ParquetFile(f)
    except pyarrow.ArrowInvalid as e:
        raise DataError(f"shard {url}: not a Parquet file: {e}") from e
    columns = parquet.schema_arrow.names
    if missing := [k for k in required_fields if k not in columns]:
        raise DataError(f"shard {url}: no column(s) {missing}; it has {columns}")
    return parquet


def _chunks(f, n):
    """The first ``n`` bytes of a file, 1 MiB at a time (a decompressing read may return less)."""
    while n > 0 and (chunk := f.read(min(n, 1 << 20))):
        n -= len(chunk)
        yield chunk


def _first_byte(url, open_shard):
    """A shard's first byte past whitespace and a UTF-8 BOM: b"[" begins a JSON array."""
    with open_shard(url) as f:
        while chunk := f.read(4096):
            if rest := chunk.lstrip(b" \t\r\n\xef\xbb\xbf"):
                return rest[:1]
    return b""


def _lines_before(slot, open_shard, required_fields):
    """The lines (Parquet: rows) of a shard before the slot's split: for line numbers."""
    url, start = slot["url"], slot["start"]
    with open_shard(url) as f:
        if "row_group" in slot:
            meta = _parquet_file(f, url, required_fields).metadata
            return sum(meta.row_group(g).num_rows for g in range(start))
        return sum(chunk.count(b"\n") for chunk in _chunks(f, start - 1)) + 1  # before line 1


# -- Retries: a transient network fault is retried, anything else fails at once ----------------

HTTP_TIMEOUT = (10, 60)  # seconds to connect, and per read, of every request (_one_owner)
RETRY_TIME = 240  # seconds that faults in a row are retried at most (DESIGN.md section 10)


def _one_owner(url):
    """smart_open's transport_params: retries left to _Retry, S3's GET deferred (DESIGN.md 10)."""
    if url.startswith("s3://"):
        import botocore.config
        config = botocore.config.Config(connect_timeout=HTTP_TIMEOUT[0], retries={
            "total_max_attempts": 1}, read_timeout=HTTP_TIMEOUT[1])
        return {"defer_seek": True, "client_kwargs": {"S3.Client": {"config": config}}}
    once = {"timeout": HTTP_TIMEOUT, "retry": None}  # (google-cloud-storage's arguments)
    if url.startswith("gs://"):
        return {"get_blob_kwargs": once, "blob_open_kwargs": once}
    return {"timeout": HTTP_TIMEOUT} if url.startswith(("http://", "https://")) else {}


def _merged(mine, theirs):
    """``theirs`` over ``mine``, dict by dict: a user's S3.Client arguments keep the kit's."""
    return {**mine, **theirs, **{k: _merged(v, theirs[k]) for k, v in mine.items()
                                 if isinstance(v, dict) and isinstance(theirs.get(k), dict)}}


# Network faults worth retrying, by class name (builtins', urllib3's, requests', botocore's).
_TRANSIENT = {"ConnectionError", "TimeoutError", "IncompleteRead", "ProtocolError",
              "ChunkedEncodingError", "ReadTimeoutError", "ConnectTimeoutError", "ReadTimeout",
              "ConnectTimeout", "ResponseStreamingError", "IncompleteReadError",
              "EndpointConnectionError"}
_TRANSIENT_S3_CODES = {"RequestTimeout", "SlowDown", "Throttling", "InternalError",
                       "ServiceUnavailable"}  # S3 says "try again" with these (some are 400s)


def _causes(error):
    """The error and what caused it, in turn: smart_open wraps the SDKs' errors in its own."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _http_status(error):
    """The HTTP status that an error (or one of its causes) reports, else None."""
    for e in _causes(error):
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore's ClientError
            if response.get("Error", {}).get("Code") in _TRANSIENT_S3_CODES:
                return 503
            return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if getattr(response, "status_code", None) is not None:  # requests' HTTPError
            return response.status_code
    return None


def is_transient(error):
    """A dropped connection, a timeout or a 5xx/429 answer: worth retrying (DESIGN.md 10)."""
    status = _http_status(error)
    if status is not None:
        return status >= 500 or status in (408, 429)
    names = {c.__name__ for e in _causes(error) for c in type(e).__mro__}
    return "SSLError" not in names and bool(names & _TRANSIENT)


def _permanent(url, where, error):
    """The error to raise for a shard that cannot be read, naming it and why."""
    status, text = _http_status(error), f"{type(error).__name__}: {error}"
    if isinstance(error, FileNotFoundError) or status == 404:  # also NoSuchKey, NoSuchBucket
        return FileNotFoundError(f"shard {url} does not exist ({text})")
    if isinstance(error, PermissionError) or status == 403:  # also AccessDenied
        return PermissionError(f"shard {url}: access denied ({text})")
    if "ignored the range request" in text:
        return OSError(f"shard {url}: the server ignores HTTP Range requests ({text}), which "
                       "resuming or cutting a shard needs: serve it from one that answers them "
                       "(nginx, S3, GCS; not `python -m http.server`), or download it first.")
    return OSError(f"shard {url}: read failed after {where}: {text}")


class _Retry:
    """Retries of transient faults (is_transient), with backoff (DESIGN.md section 10)."""

    def __init__(self, retries, delay):
        self.retries, self.delay, self.since = retries, delay, 0.0

    def after_fault(self, error, url, where, n):
        """Raises ``error`` for what it is, or waits before attempt n + 1 (a transient fault)."""
        if isinstance(error, DataError):
            raise error
        if not is_transient(error):
            raise _permanent(url, where, error) from error
        if n == 0:  # the first fault in a row starts the clock
            self.since = time.monotonic()
        delay, spent = min(self.delay * 2**n, 60), time.monotonic() - self.since
        if n == self.retries or spent + delay > RETRY_TIME:
            raise OSError(f"shard {url}: still failing after {n} retries in {spent:.0f} s, at "
                          f"{where}: {error}") from error
        log.warning("shard %s, %s: %s: %s; retry %d of %d in %.1f s", url, where,
                    type(error).__name__, error, n + 1, self.retries, delay)
        time.sleep(delay)

    def next(self, readers, i, slot, reader):
        """The next (data, where the next one starts) of ``readers[i]``, or None; faults retried."""
        for n in range(self.retries + 1):
            try:
                if readers[i] is None:  # (opened first, or reopened after a fault)
                    readers[i] = reader(slot)
                return next(readers[i], None)
            except Exception as e:  # the reader is dropped: give up, or reopen it
                readers[i] = None
                self.after_fault(e, slot["url"], _where(slot), n)

    def run(self, url, where, attempt):
        """attempt(), again after transient faults (``retries`` in all)."""
        for n in range(self.retries + 1):
            try:
                return attempt()
            except Exception as e:
                self.after_fault(e, url, where, n)


# -- The other sources -------------------------------------------------------------------------

class HFDataset(Stage):
    """A Hugging Face ``Dataset`` or ``IterableDataset``, once or for ``epochs`` (DESIGN.md 10)."""

    def __init__(self, dataset, *, repeat=False, epochs=None, shuffle=False, seed=0,
                 required_fields=()):
        import datasets  # imported here: only this stage needs the library

        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs={epochs}: pass at least 1, or None for endless")
        self.dataset = dataset
        self.streaming = isinstance(dataset, datasets.IterableDataset)
        if shuffle and self.streaming:
            raise ValueError("shuffle=True needs a map-style Dataset; shuffle a stream with "
                             "the Shuffle stage")
        self.repeat, self.epochs = repeat, epochs if repeat else 1
        self.shuffle, self.seed, self.required_fields = shuffle, seed, tuple(required_fields)
        self.config = {"dataset": dataset.info.dataset_name, "split": str(dataset.split),
                       "columns": dataset.column_names, "repeat": repeat, "epochs": self.epochs,
                       "shuffle": shuffle, "seed": seed,
                       **({"n_shards": dataset.n_shards} if self.streaming
                          else {"rows": len(dataset)})}
        self.epoch, self.index = 0, 0  # index: rows handed out in this epoch
        self._it = None                # the running iterator of a streaming dataset
        self._resumed = None           # its state to start from, until the iterator runs
        self._block = (None, [])       # (first index, rows) read from a map-style dataset
        self._order = None             # this epoch's permutation of a map-style dataset

    def _next_row(self):
        if self.streaming:
            self._it = self._it or iter(self.dataset)
            return next(self._it, None)
        if self.index == len(self.dataset):
            return None
        start = self.index - self.index % 1024
        if self._block[0] != start:
            if self.shuffle and self._order is None:  # derived from (seed, epoch): not saved
                seed = random.Random(f"{self.seed}-{self.epoch}").getrandbits(63)
                # A tensor, not a list: 8 bytes a row, for datasets of many millions of rows.
                self._order = torch.randperm(len(self.dataset),
                                             generator=torch.Generator().manual_seed(seed))
            rows = (self._order[start:start + 1024].tolist() if self.shuffle
                    else range(start, min(start + 1024, len(self.dataset))))
            columns = self.dataset[rows]
            self._block = (start, [dict(zip(columns, row)) for row in zip(*columns.values())])
        return self._block[1][self.index - start]

    def __next__(self):
        began_epoch = False  # did this call begin an epoch (and find it empty)?
        while (row := self._next_row()) is None:
            if not self.repeat or (self.epochs is not None and self.epoch + 1 >= self.epochs):
                raise StopIteration
            if began_epoch and self.epochs is None:  # endless and empty: it would loop forever
                raise DataError(f"dataset {self.config['dataset']} ({self.config['split']}) "
                                "has no rows")
            self.epoch, self.index, self._it, self._resumed = self.epoch + 1, 0, None, None
            self._block, self._order, began_epoch = (None, []), None, True
            if self.streaming:
                self.dataset.set_epoch(self.epoch)
        self.index += 1
        if missing := _missing(row, self.required_fields):
            raise DataError(f"dataset {self.config['dataset']} ({self.config['split']}), epoch "
                            f"{self.epoch}, row {self.index}: missing or null field(s) "
                            f"{missing}; it has {sorted(row)}")
        return row

    def state_dict(self):
        inner = self.dataset.state_dict() if self._it is not None else self._resumed
        return self._state(epoch=self.epoch, index=self.index, dataset=inner)

    def load_state_dict(self, state):
        self._load(state)
        self.close()
        self.epoch, self.index, self._resumed = state["epoch"], state["index"], state["dataset"]
        self._block, self._order = (None, []), None
        if self.streaming:
            self.dataset.set_epoch(self.epoch)
            if self._resumed is not None:
                self.dataset.load_state_dict(self._resumed)

    def close(self):
        if self._it is not None:  # a later next() goes on from here, in a new iterator
            self._resumed = self.dataset.state_dict()
            self._it.close()
            self._it = None
            self.dataset.load_state_dict(self._resumed)


# --- Pretraining transforms, in pipeline order: Tokenize, EnsureBosEos, ConcatChunk, Shuffle ------

def _crc(text):
    """A document's crc32: what a resume checks it skips (Tokenize) or reads on from (Files)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def _crcs(crcs, start=0):
    """One crc32 of many documents' crc32s."""
    return zlib.crc32(array.array("I", crcs).tobytes(), start)


class Tokenize(Stage):
    """Adds ``input_ids``: ``sample[column]`` tokenized on threads (DESIGN.md 2, rule 1, and 6)."""

    # Not in the config: where a batch ends does not change the stream (DESIGN.md 2, rule 1).
    BATCH_CHARS = 1 << 20
    CHANGED = ("the data changed since this run read it: the documents read again after its "
               "checkpoint are not the ones it trained on then (a shard was edited, or records "
               "added before what it had read). Resuming would train on some documents twice "
               "and skip others: restore the files, or start a new run on the new data")

    def __init__(self, src, tokenizer, *, column="text", num_threads=2, batch_size=64,
                 add_special_tokens=True, max_chars=None):
        self.src, self.column, self.batch_size = src, column, batch_size
        self.max_chars, self._cuts = max_chars, itertools.count(1)
        self.add_special_tokens = add_special_tokens
        self.num_threads = max(1, num_threads)
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is None and hasattr(tokenizer, "encode_batch_fast"):
            self.backend = tokenizer  # a bare tokenizers.Tokenizer
        self.tokenizer = tokenizer
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        vocab = (self.backend.get_vocab_size(with_added_tokens=True) if self.backend
                 else len(tokenizer))
        self.config = {"tokenizer": name, "vocab_size": vocab, "column": column,
                       "batch_size": batch_size, "add_special_tokens": add_special_tokens,
                       "max_chars": max_chars}
        self._pool, self._per_thread = None, threading.local()  # _per_thread: see _work
        self._popped = 0                      # batches taken by __next__ (see _work)
        self._inflight = collections.deque()  # (upstream states, future) of each batch
        self._batch, self._pos = [], 0        # the batch being handed out and our place in it
        self._crcs = []                       # the crc32 of each sample's text in self._batch
        self._marks = []                      # per sample: the state once it is handed out
        self._states = None                   # upstream states before each document, and after
        self._skip = 0                        # samples of a resumed state still to pass
        self._skipped = (None, 0)             # (crc the skipped samples must have, theirs)
        self._exhausted = False

    def _encode(self, texts):
        if self.backend is not None:
            encs = self.backend.encode_batch_fast(texts, add_special_tokens=self.add_special_tokens)
            return [e.ids for e in encs]
        return self.tokenizer(texts, add_special_tokens=self.add_special_tokens)["input_ids"]

    @staticmethod
    def check_record(record, column="text"):
        """What Tokenize needs of a record: for Files(check=...), which names shard and line."""
        if not isinstance(record.get(column), str):
            raise ValueError(f"field {column!r} is {type(record.get(column)).__name__}, not a "
                             f"string (keys: {sorted(record)})")

    def _work(self, samples, seq):
        for sample in samples:  # (a token file's records come with their ids: passed on)
            if not isinstance(sample.get(self.column), str) and "input_ids" not in sample:
                raise ValueError(f"Tokenize: a sample has no string field {self.column!r} (keys: "
                                 f"{sorted(sample)}); Files(..., check=Tokenize.check_record) "
                                 "reports such records with their shard and line")
        pieces = [[s] if "input_ids" in s else _pieces(s, self.column, self.max_chars, self._cuts)
                  for s in samples]
        # Piece i of document d handed out: (states[d + 1], 0) if last, else (states[d], i + 1).
        marks = [(d + 1, 0) if i == len(cut) - 1 else (d, i + 1)
                 for d, cut in enumerate(pieces) for i in range(len(cut))]
        samples = [piece for cut in pieces for piece in cut]
        texts = [s for s in samples if "input_ids" not in s]
        # About 1M characters a call: all pieces of a huge document at once would take GBs.
        ids, start, chars = [], 0, 0
        for i, sample in enumerate(texts, 1):
            chars += len(sample[self.column])
            if chars >= 1 << 20 or i == len(texts):
                ids += self._encode([s[self.column] for s in texts[start:i]])
                start, chars = i, 0
        for sample, sample_ids in zip(texts, ids):
            sample["input_ids"] = sample_ids
        # The thread frees the id lists it made once their batch is handed out (DESIGN.md 6).
        made = self._per_thread.__dict__.setdefault("batches", collections.deque())
        made.append((seq, ids))
        while made[0][0] < self._popped - 1:  # (batch _popped - 1 is being handed out)
            made.popleft()
        return samples, [_crc(s.get(self.column, "")) for s in samples], marks

    def _submit(self):
        states, samples, chars = [self.src.state_dict()], [], 0
        try:
            # A budget in characters too: 64 documents of 10 MB would be a batch of 640 MB.
            while len(samples) < self.batch_size and chars < self.BATCH_CHARS:
                samples.append(next(self.src))
                states.append(self.src.state_dict())
                text = samples[-1].get(self.column)  # (a token file's ids: 4 characters each)
                chars += len(text) if isinstance(text, str) else 4 * len(samples[-1].get(
                    "input_ids", ()))
        except StopIteration:
            self._exhausted = True
        if samples:
            self._pool = self._pool or ThreadPoolExecutor(self.num_threads, "tokenize")
            seq = self._popped + len(self._inflight)  # the batch's number, from 0
            self._inflight.append((states, self._pool.submit(self._work, samples, seq)))

    def __next__(self):
        while self._pos == len(self._batch):
            while not self._exhausted and len(self._inflight) < 2 * self.num_threads:
                self._submit()
            if not self._inflight:
                raise StopIteration
            self._states, future = self._inflight.popleft()
            self._batch, self._crcs, self._marks = future.result()  # raises what it raised
            self._popped += 1  # (after the batch before is let go: see _work)
            # A resumed skip may pass whole batches (a skip counted from an earlier batch's state).
            self._pos = min(self._skip, len(self._batch))
            self._skip -= self._pos
            if self._skipped[0] is not None:
                self._check_skipped()
        sample = self._batch[self._pos]
        self._pos += 1
        return sample

    def _check_skipped(self):
        """The samples a resume skipped must be those handed out before its checkpoint."""
        want, got = self._skipped
        got = _crcs(self._crcs[:self._pos], got)
        if self._skip == 0 and got != want:
            raise DataError(self.CHANGED)
        self._skipped = (want, got) if self._skip else (None, 0)

    def state_dict(self):
        if self._states is None:  # nothing handed out yet (or only what we resumed past)
            return self._state(upstream=self.src.state_dict(), skip=self._skip,
                               crc=self._skipped[0])
        document, skip = self._marks[self._pos - 1]
        crc = _crcs(self._crcs[self._pos - skip:self._pos]) if skip else None
        return self._state(upstream=self._states[document], skip=skip, crc=crc)

    def load_state_dict(self, state):
        self._load(state)
        self._skip = state["skip"]
        # (A state of an older version has no crc: its skip is not checked.)
        self._skipped = (state.get("crc") if self._skip else None, 0)

    def reshard_state(self, olds, ctx):
        """The upstream states as they are: each is where its rank's consumer stood."""
        if any(old["skip"] for old in olds):
            raise ValueError("a rank stopped inside a document that Tokenize had cut (max_chars), "
                             "or saved a skip past whole documents with an older version; resume "
                             "on the same number of ranks, and change it at a later checkpoint")
        return self._state(upstream=self._reshard_upstream(olds, ctx), skip=0, crc=None)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._inflight.clear()
        super().close()


def _cut_points(text, n):
    """Where a document is cut: every ``n`` characters at most, after a blank in the second half."""
    points = [0]
    while len(text) - points[-1] > n:
        end = points[-1] + n
        blank = max(text.rfind(" ", end - n // 2, end), text.rfind("\n", end - n // 2, end))
        points.append(blank + 1 if blank > 0 else end)
    return points + [len(text)]


def _pieces(sample, column, max_chars, cuts):
    """A document longer than max_chars, cut into pieces tagged ``piece`` = [i, n] (DESIGN.md 2)."""
    text = sample[column]
    if max_chars is None or len(text) <= max_chars:
        return [sample]
    points = _cut_points(text, max_chars)
    count = next(cuts)
    if count == 1 or count % 1000 == 0:  # a corpus of books would flood the log
        log.warning("Tokenize: cut a document of %d characters into %d pieces of at most "
                    "%d (%d documents cut by this process so far)", len(text),
                    len(points) - 1, max_chars, count)
    return [{**sample, column: text[a:b], "piece": [i, len(points) - 1]}
            for i, (a, b) in enumerate(zip(points, points[1:]))]


class EnsureBosEos(Stage):
    """BOS first and EOS last in every document: only EOS when they are one token (DESIGN.md 2)."""

    def __init__(self, src, tokenizer):
        self.src, self.bos, self.eos = src, tokenizer.bos_token_id, tokenizer.eos_token_id
        self.config = {"bos": self.bos, "eos": self.eos}

    def __next__(self):
        sample = next(self.src)
        ids = sample["input_ids"]
        piece, pieces = sample.get("piece", (0, 1))  # a long document cut by Tokenize
        if self.bos is not None and self.bos != self.eos and (not ids or ids[0] != self.bos) \
                and piece == 0:
            ids = [self.bos] + ids
        if self.eos is not None and (not ids or ids[-1] != self.eos) and piece == pieces - 1:
            ids = ids + [self.eos]
        sample["input_ids"] = ids
        return sample


def as_int64(ids, stage):
    """A document's ids as int64 bytes by ``array('Q')``, refusing ids below 0 (DESIGN.md 6)."""
    try:
        return memoryview(array.array("Q", ids)).cast("B")
    except OverflowError:
        raise ValueError(f"{stage}: input_ids hold an id below 0 or above 2**63 (from "
                         f"{min(ids)} to {max(ids)}); token ids index the vocabulary") from None


def as_tensor(ids):
    """A 1-D long tensor of an ``array('q')`` slice, by one memory copy (DESIGN.md section 6)."""
    return torch.frombuffer(ids, dtype=torch.long) if len(ids) else torch.zeros(0, dtype=torch.long)


class ConcatChunk(Stage):
    """Documents concatenated, cut into chunks of ``length`` tokens; the leftover is state."""

    def __init__(self, src, length):
        self.src, self.length = src, length
        self.config = {"length": length}
        self.buf, self.pos = array.array("q"), 0  # tokens not yet emitted are buf[pos:]

    def __next__(self):
        while len(self.buf) - self.pos < self.length:
            ids = next(self.src)["input_ids"]
            del self.buf[:self.pos]  # compact only when pulling, so long documents are cut
            self.pos = 0             # by moving pos, without copying the rest each time
            self.buf.frombytes(as_int64(ids, "ConcatChunk"))
        chunk = self.buf[self.pos:self.pos + self.length]
        self.pos += self.length
        return {"input_ids": as_tensor(chunk)}

    def state_dict(self):
        return self._state(rest=self.buf[self.pos:].tolist())

    def load_state_dict(self, state):
        self._load(state)
        self.buf, self.pos = array.array("q", state["rest"]), 0

    def reshard_state(self, olds, ctx):
        """The leftover tokens of old rank i move to new rank i mod (new world size)."""
        rest = [t for i in ctx.mine for t in olds[i]["rest"]]
        ctx.report["tokens_moved"] += sum(len(olds[i]["rest"]) for i in ctx.mine if i != ctx.rank)
        return self._state(upstream=self._reshard_upstream(olds, ctx), rest=rest)


def to_json(sample):
    """A sample as JSON-able data: tensors become {"__tensor__": list, "dtype": name}."""
    if isinstance(sample, torch.Tensor):
        return {"__tensor__": sample.tolist(), "dtype": str(sample.dtype).removeprefix("torch.")}
    if isinstance(sample, dict):
        return {k: to_json(v) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return [to_json(v) for v in sample]
    return sample


def from_json(data):
    """The inverse of to_json."""
    if isinstance(data, dict):
        if "__tensor__" in data:
            return torch.tensor(data["__tensor__"], dtype=getattr(torch, data["dtype"]))
        return {k: from_json(v) for k, v in data.items()}
    if isinstance(data, list):
        return [from_json(v) for v in data]
    return data


class Shuffle(Stage):
    """A buffered shuffle (1: none); each sample is made JSON once, while it waits (DESIGN.md 2)."""

    def __init__(self, src, buffer_size, *, seed=0):
        self.src, self.buffer_size, self.seed = src, buffer_size, seed
        self.config = {"buffer_size": buffer_size, "seed": seed}
        self.rng = random.Random(seed)
        self.buffer = []  # [sample, its to_json() form or None]
        self.exhausted = False

    def __next__(self):
        while not self.exhausted and len(self.buffer) < self.buffer_size:
            try:
                self.buffer.append([next(self.src), None])
            except StopIteration:
                self.exhausted = True
        if not self.buffer:
            raise StopIteration
        i = self.rng.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()[0]

    def state_dict(self):
        for entry in self.buffer:
            if entry[1] is None:
                entry[1] = to_json(entry[0])
        return self._state(buffer=[entry[1] for entry in self.buffer], exhausted=self.exhausted,
                           rng=_rng_to_json(self.rng))

    def load_state_dict(self, state):
        self._load(state)
        self.buffer = [[from_json(s), s] for s in state["buffer"]]
        self.exhausted = state["exhausted"]
        _rng_from_json(self.rng, state["rng"])

    def reshard_state(self, olds, ctx):
        """Old rank i's buffer moves to new rank i mod W'; the RNG goes on (DESIGN.md 4)."""
        buffer = [sample for i in ctx.mine for sample in olds[i]["buffer"]]
        ctx.report["sequences_moved"] += sum(len(olds[i]["buffer"]) for i in ctx.mine
                                             if i != ctx.rank)
        return self._state(upstream=self._reshard_upstream(olds, ctx), buffer=buffer,
                           exhausted=False, rng=ctx.rng(olds))


# --- Fine-tuning on instructions (SFT): FormatInstructions, Pack, Pad -----------------------------

# The layout of an instruction record (Alpaca's "### " headers): DESIGN.md section 8.
PROMPT = "{preamble}### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = ("{preamble}### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
                     "### Response:\n")
PREAMBLE = "Answer the instruction below.\n\n"


def instruction_prompt(instruction, input="", preamble=PREAMBLE):
    """The text before an instruction record's answer (generate.py wraps its prompts in it too)."""
    template = PROMPT_WITH_INPUT if input else PROMPT
    return template.format(preamble=preamble, instruction=instruction, input=input)


class FormatInstructions(Stage):
    """Instruction records -> ``input_ids`` and ``labels``, the prompt masked (DESIGN.md 8)."""

    def __init__(self, src, tokenizer, *, preamble=PREAMBLE, label_pad_id=-100):
        self.src, self.tokenizer, self.preamble = src, tokenizer, preamble
        self.label_pad_id = label_pad_id
        self.config = {"tokenizer": getattr(tokenizer, "name_or_path", ""), "preamble": preamble,
                       "label_pad_id": label_pad_id}

    def _encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def check_record(record):
        """What FormatInstructions needs of a record: for Files(check=...) (shard and line)."""
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) for m in messages):
                raise ValueError("'messages' must be a non-empty list of {role, content}")
            if messages[-1].get("role") != "assistant":  # else the last turn trains as answer
                raise ValueError(f"the last message is {messages[-1].get('role')!r}, not "
                                 "'assistant': a chat record ends with the answer to learn")
        elif "text" in record and "instruction" not in record:
            raise ValueError("plain text ('text'), not instruction data: --task sft learns "
                             "from 'instruction'/'output' or 'messages' records; plain text "
                             "trains with --task pretrain")
        elif not isinstance(record.get("instruction"), str) or not isinstance(
                record.get("output"), str):
            raise ValueError("an instruction record needs string fields 'instruction' and "
                             f"'output' (or a list 'messages'); it has {sorted(record)}")

    def check(self, record):
        """check_record, and a chat template for a chat record (else a DataError: DESIGN.md 5)."""
        self.check_record(record)
        if "messages" in record and not getattr(self.tokenizer, "chat_template", None):
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise DataError(f"the data is chat-format ('messages') and the tokenizer {name} has "
                            "no chat template; pass a --tokenizer that has one (or convert the "
                            "records to instruction/output)")

    def __next__(self):
        record = next(self.src)
        self.check(record)
        if "messages" in record:
            messages = record["messages"]
            prompt = list(self.tokenizer.apply_chat_template(
                messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False))
            ids = list(self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                          return_dict=False))
            if ids[:len(prompt)] != prompt:
                raise ValueError("FormatInstructions: the chat template renders the prompt "
                                 "differently inside the whole conversation; cannot mask it")
        else:
            text = instruction_prompt(record["instruction"], record.get("input", ""), self.preamble)
            bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
            prompt = ([bos] if bos is not None else []) + self._encode(text)
            ids = prompt + self._encode(record["output"]) + ([eos] if eos is not None else [])
        labels = [self.label_pad_id] * len(prompt) + ids[len(prompt):]
        return {"input_ids": ids, "labels": labels}


def _ids_and_labels(sample):
    ids = sample["input_ids"]
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    labels = sample.get("labels", ids)
    labels = labels.tolist() if isinstance(labels, torch.Tensor) else list(labels)
    if len(labels) != len(ids):
        raise ValueError(f"a sample has {len(ids)} input_ids but {len(labels)} labels")
    return ids, labels


def _padded(ids, labels, length, pad_id, label_pad_id):
    """input_ids, attention_mask and labels of one sequence, padded to ``length``."""
    pad = length - len(ids)
    return {"input_ids": torch.tensor(ids + [pad_id] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
            "labels": torch.tensor(labels + [label_pad_id] * pad)}


class Pack(Stage):
    """Packs whole samples greedily into sequences of ``length`` tokens (DESIGN.md section 8)."""

    def __init__(self, src, length, *, pad_id=0, label_pad_id=-100, discard_long=False):
        self.src, self.length, self.pad_id = src, length, pad_id
        self.label_pad_id, self.discard_long = label_pad_id, discard_long
        self.config = {"length": length, "pad_id": pad_id, "label_pad_id": label_pad_id,
                       "discard_long": discard_long}
        self.waiting = []  # [ids, labels] read, not packed yet (several only after a reshard)
        self.discarded = 0

    def _next_sample(self):
        while True:
            ids, labels = _ids_and_labels(next(self.src))
            if len(ids) <= self.length:
                return [ids, labels]
            if not self.discard_long:
                return [ids[:self.length], labels[:self.length]]
            self.discarded += 1
            log.warning("Pack: dropped a sample of %d tokens (> %d); %d so far", len(ids),
                        self.length, self.discarded)

    def __next__(self):
        ids, labels, positions = [], [], []
        while True:
            if not self.waiting:
                try:
                    self.waiting.append(self._next_sample())
                except StopIteration:
                    if not ids:
                        raise
                    break
            sample_ids, sample_labels = self.waiting[0]
            if len(ids) + len(sample_ids) > self.length:
                break
            ids += sample_ids
            labels += ([self.label_pad_id] + sample_labels[1:]) if sample_labels else []
            positions += range(len(sample_ids))
            self.waiting.pop(0)
        out = _padded(ids, labels, self.length, self.pad_id, self.label_pad_id)
        out["position_ids"] = torch.tensor(positions + [0] * (self.length - len(ids)))
        return out

    def state_dict(self):
        return self._state(waiting=list(self.waiting), discarded=self.discarded)

    def load_state_dict(self, state):
        self._load(state)
        self.waiting, self.discarded = self._waiting(state), state["discarded"]

    def reshard_state(self, olds, ctx):
        """The waiting samples of old rank i move to new rank i mod (new world size)."""
        ctx.report["sequences_moved"] += sum(len(self._waiting(olds[i])) for i in ctx.mine
                                             if i != ctx.rank)
        return self._state(upstream=self._reshard_upstream(olds, ctx),
                           waiting=[s for i in ctx.mine for s in self._waiting(olds[i])],
                           discarded=sum(olds[i]["discarded"] for i in ctx.mine))

    @staticmethod
    def _waiting(state):
        old = state.get("pending")  # (states of earlier versions: one sample, or None)
        return list(state["waiting"]) if "waiting" in state else [old] if old else []


class Pad(Stage):
    """Pads each sample to ``length`` tokens (longer: an error unless ``truncate``; DESIGN.md 2)."""

    def __init__(self, src, length, *, pad_id, label_pad_id=-100, truncate=False):
        self.src, self.length, self.pad_id = src, length, pad_id
        self.label_pad_id, self.truncate = label_pad_id, truncate
        self.config = {"length": length, "pad_id": pad_id, "label_pad_id": label_pad_id,
                       "truncate": truncate}

    def __next__(self):
        ids, labels = _ids_and_labels(next(self.src))
        if len(ids) > self.length:
            if not self.truncate:
                raise ValueError(f"Pad: a sample of {len(ids)} tokens is longer than "
                                 f"length={self.length}; pass truncate=True to cut such samples")
            ids, labels = ids[:self.length], labels[:self.length]
        return _padded(ids, labels, self.length, self.pad_id, self.label_pad_id)


# --- Batching and prefetching: collate, Batch, Prefetch -------------------------------------------

def collate(samples):
    """Stacks samples' tensors, makes a tensor of each field of numbers (domain), lists the rest."""
    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"cannot stack {key!r}: samples have shapes {sorted(shapes)}; "
                                 "chunk or pad to one length before Batch")
            out[key] = torch.stack(values)
        elif isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            out[key] = torch.tensor(values)
        else:
            out[key] = values
    return out


class Batch(Stage):
    """``batch_size`` samples as one (collate), in one next(): no partial batch is ever state."""

    def __init__(self, src, batch_size, *, drop_last=False, collate_fn=collate):
        self.src, self.batch_size, self.drop_last = src, batch_size, drop_last
        self.collate_fn = collate_fn
        # No batch_size: Batch keeps no state, so a resumed run may group samples otherwise.
        self.config = {"drop_last": drop_last}

    def __next__(self):
        samples = list(itertools.islice(self.src, self.batch_size))
        if not samples or (self.drop_last and len(samples) < self.batch_size):
            raise StopIteration
        return self.collate_fn(samples)


class Prefetch(Stage):
    """The upstream run ``depth`` items ahead in a forked process; ``counters``: data.counters."""

    def __init__(self, src, depth=2, *, pin_memory=False, follow=None, every=1, until=None):
        self.src, self.depth, self.until, self.interrupted = src, depth, until, False
        self.pin_memory, self.follow, self.every = pin_memory, follow, every
        self._conn = self._pid = self._end = None
        self._ready, self._taken, self._followed, self.counters = collections.deque(), 0, 0, {}
        self._stopped = 0  # (seconds the child was seen stopped while waited for)
        self._got, self._ring = bytearray(), {}  # (bytes read ahead: _recv; pinned: _own)
        self._copied = torch.cuda.Event() if pin_memory else None

    def _start(self):
        if self._pid is None:
            self._conn, theirs = multiprocessing.Pipe()
            self._waiting = select.poll()
            self._waiting.register(self._conn.fileno(), select.POLLIN)
            size = min(SLOT_BYTES, SHARED_BYTES // self.depth) // 64 * 64  # (a slot's bytes)
            self._slots = mmap.mmap(-1, self.depth * size, flags=mmap.MAP_SHARED | NORESERVE)
            self._view = np.frombuffer(self._slots, np.uint8)
            sys.stdout.flush(), sys.stderr.flush()  # (or the child would write them again)
            parent, self._pid = os.getpid(), os.fork()
            if self._pid == 0:
                self._conn.close()
                _serve(theirs, self.src, self.depth, self.every if self.follow else 0, parent,
                       self._slots)
            theirs.close()
            self._stop = weakref.finalize(self, _stop, self._conn, self._pid)  # (or at exit)
            self._ask(("more", self.depth))

    def _ask(self, message, kind=None):
        """Sends ``message`` (if any), then returns the child's next reply of ``kind``."""
        try:
            if message:
                self._conn.send_bytes(pickle.dumps(message))  # (torch's reducers: 5 µs)
            while kind and (reply := self._recv())[0] != kind:
                self._ready.append(reply)
            return reply if kind else None
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise ChildProcessError(self._ended()) from None

    def _follow(self):
        """At a step's end: the mixer as learn_late left it, for the child's next draws."""
        if self.follow and self._taken % self.every == 0 and \
                self._taken // self.every > self._followed:
            self._ask(("mixer", self.follow.state_dict()))
            self._followed += 1

    def peek(self):
        """Waits for the first item, and raises what making it raised (first_read)."""
        self._start()
        if not self._ready:
            self._ready.append(self._ask(None, "item"))
        if self._ready[0][3] is not None and not isinstance(self._ready[0][3], StopIteration):
            raise self._ready[0][3]

    def __next__(self):
        if self._end is not None:
            raise self._end
        self._start()
        self._follow()
        _, item, self.counters, error = self._ready.popleft() if self._ready else self._item()
        if error is not None:
            self._end = StopIteration() if isinstance(error, StopIteration) else error
            raise self._end
        if isinstance(item, dict):  # (copied out of its slot before the child may reuse it)
            item = self._own(item)
        self._taken += 1
        credits = self.every if self.every < self.depth else 1  # a step's at once: one wake-up
        if self._taken % credits == 0:
            self._ask(("more", credits))
        return item

    def _own(self, item):
        """``item``'s tensors out of its slot in one copy, into their own or pinned memory."""
        shared = [v for v in item.values() if isinstance(v, Shared)]
        start, size = (shared[0].offset, shared[-1].end - shared[0].offset) if shared else (0, 0)
        if not self.pin_memory:
            block = np.empty(size, np.uint8)
        else:  # the buffer of two steps back, whose copy was issued before the last step began
            if self._taken % self.every == 0:
                self._copied.synchronize()  # (the last step's start: never recorded, no wait)
                self._copied.record()
            i = self._taken % (2 * self.every)
            if len(block := self._ring.get(i, np.empty(0, np.uint8))) < size:
                block = self._ring[i] = torch.empty(size, dtype=torch.uint8).pin_memory().numpy()
        block[:size] = self._view[start:start + size]  # (numpy's copy: torch's takes threads)
        for key, value in item.items():
            if isinstance(value, Shared):
                value = np.ndarray(value.shape, value.dtype, block, value.offset - start)
                item[key] = torch.from_numpy(value)
            elif isinstance(value, np.ndarray):  # (too big for its slot: it crossed the pipe)
                value = torch.from_numpy(value)
                item[key] = value.pin_memory() if self.pin_memory else value
        return item

    def _item(self):
        """The child's next item, or StopIteration once ``until`` is set and it is late."""
        while self.until is not None and not self._got and not self._poll():
            if self.until.is_set():  # (a signal while a read hangs: the run saves and ends)
                os.kill(self._pid, signal.SIGUSR1)  # the child then only answers "state"
                self._taken -= self._taken % self.every
                self._end, self.interrupted = StopIteration(), True
                raise self._end
        return self._ask(None, "item")

    def _ended(self):
        """Why the child ended, reaped here once (its pid is then no longer this stage's)."""
        if self._stop.detach() is None:  # (reaped already)
            return f"data.Prefetch's process ({self._pid}) ended"
        status = os.waitpid(self._pid, 0)[1]  # (its pipe closed as it exited)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        why = {signal.SIGKILL: " (the kernel's out-of-memory killer, or a kill -9)",
               signal.SIGABRT: " (a library's fatal error: tokenizers' when memory runs out)"}
        how = f"was killed by {signal.Signals(sig).name}{why.get(sig, '')}" if sig else \
            f"exited ({os.waitstatus_to_exitcode(status)})"
        return f"data.Prefetch's process ({self._pid}), which reads the data ahead, {how}"

    def _poll(self):
        """Whether the child's next message waits, after a second at most; a child stopped for
        3 s (SIGSTOP, a debugger) is an error, not a hang (Linux's /proc tells)."""
        if self._waiting.poll(1000):  # (select.poll: the 1 µs of a poll that finds data)
            self._stopped = 0
            return True
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{self._pid}/stat").read_text()
            self._stopped = (self._stopped + 1) * (stat[stat.rindex(")") + 2] in "Tt")
        if self._stopped >= 3:
            raise ChildProcessError(f"data.Prefetch's process ({self._pid}), which reads the "
                                    "data ahead, is stopped (SIGSTOP, or a debugger)")
        return False

    def _recv(self):
        """The child's next message; a read takes in all that wait (send_bytes: length, bytes)."""
        while len(self._got) < 4 or len(self._got) < 4 + int.from_bytes(self._got[:4], "big"):
            while not self._poll():
                pass
            if not (data := os.read(self._conn.fileno(), 1 << 20)):
                raise EOFError
            self._got += data
        n = 4 + int.from_bytes(self._got[:4], "big")
        message = pickle.loads(self._got[4:n])
        del self._got[:n]
        return message

    def state_dict(self):
        if not self._taken:  # (this process's copy never runs: its state is the start's)
            return self._state(upstream=self.src.state_dict())
        if self.until is not None and self.until.is_set():  # a signal: a read may hang now,
            os.kill(self._pid, signal.SIGUSR1)  # and the child drops it to answer at once
        self._follow()
        return self._state(upstream=self._ask(("state", self._taken - 1), "state")[1])

    def load_state_dict(self, state):
        if self._pid is not None:
            raise RuntimeError("load_state_dict must be called before the first next()")
        self._load(state)

    def close(self):
        self._end = RuntimeError("Prefetch: next() after close()")
        if self._pid:
            self._stop()  # (once: a reaped child's pid may be another process's by now)


def _stop(conn, pid):
    """Ends Prefetch's child: nothing is left to clean up (no named shared memory, no files)."""
    conn.close()
    with contextlib.suppress(ChildProcessError, ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# The shared memory's bytes (DESIGN.md 6); MAP_NORESERVE is mmap's own from Python 3.13.
SLOT_BYTES, SHARED_BYTES = 1 << 26, 1 << 28  # a slot's most, and all slots'
NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
Shared = collections.namedtuple("Shared", "offset end shape dtype")  # a tensor in the slots


def _share(item, slots, slot, depth):
    """``item``'s tensors in ``slot`` of ``slots`` (Shared), or arrays to pickle if too big."""
    size = len(slots) // depth
    offset, end, out = slot * size, (slot + 1) * size, {}
    for key, value in item.items():
        if isinstance(value, torch.Tensor):
            value, need = value.numpy(), -(-value.nbytes // 64) * 64  # (aligned for the next)
            if offset + need <= end:
                np.ndarray(value.shape, value.dtype, buffer=slots, offset=offset)[...] = value
                value = Shared(offset, offset := offset + need, value.shape, value.dtype.str)
        out[key] = value
    return out


def _serve(conn, src, depth, every, parent, slots):
    """Prefetch's child: an item per credit ("more"), states kept ("state"), mixer's ("mixer")."""
    try:
        _die_with_parent()
        if os.getppid() != parent:  # (it died before prctl)
            return
        torch.set_num_threads(1)  # its ops are small, and OpenMP's pool did not fork
        gc.freeze()  # the parent's objects stay shared pages: the GC does not write to them
        gc.enable()
        mix = next((stage for stage in _stages(src) if isinstance(stage, Mix)), None)
        states, made, credit, followed, ended, reading = {}, 0, 0, 0, False, [False]

        def drop(signum, frame):  # Prefetch gave up waiting (until): no item is wanted now
            reading.append(signum)
            if reading[0]:  # (the child ignores SIGINT: this is the one KeyboardInterrupt)
                raise KeyboardInterrupt
        signal.signal(signal.SIGUSR1, drop)
        while True:
            if ended or not credit or every and made and made % every == 0 and \
                    followed < made // every or conn.poll():
                command, arg = conn.recv()
                if command == "more":
                    credit += arg
                elif command == "mixer":  # (at a step's end: the state is taken anew)
                    mix.mixer.load_state_dict(arg)
                    followed, states[made - 1] = followed + 1, src.state_dict()
                elif command == "state":
                    conn.send_bytes(pickle.dumps(("state", states[arg])))
                continue
            try:
                try:  # (reading ends before any handler below runs: a late SIGUSR1 lands here)
                    reading[0] = True
                    if len(reading) > 1:
                        raise KeyboardInterrupt
                    item, error = next(src), None
                finally:
                    reading[0] = False
            except KeyboardInterrupt:  # broken now: its states are left (and a stray signal told)
                item, error, ended = None, ChildProcessError(
                    f"data.Prefetch's process ({os.getpid()}) got a SIGUSR1 the trainer did not "
                    "send: it dropped its read of the data, and the pipeline cannot go on"), True
            except Exception as e:  # (StopIteration too) crosses with the child's traceback
                item, error, ended = None, _portable(e), True
            if not ended:
                states[made] = src.state_dict()
                states.pop(made - depth - 2, None)
                if isinstance(item, dict):  # (credits: the slot's last item was taken)
                    item = _share(item, slots, made % depth, depth)
            notice = ("item", item, counters(states.get(made - ended)), error)
            conn.send_bytes(pickle.dumps(notice))  # (as made: a read may hang after it)
            made, credit = made + 1, credit - 1
    except (EOFError, OSError):  # the pipe closed: close(), or the parent is gone
        pass
    except BaseException:  # a bug of its own: said before it goes
        traceback.print_exc()
    finally:
        os._exit(0)  # never the parent's atexit handlers


def _die_with_parent():
    """A process of the pipeline's dies with its parent, SIGINT and SIGTERM ignored (DESIGN 6)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _portable(error):
    """``error`` with the child's traceback as a note, or a RuntimeError if it cannot cross."""
    if not isinstance(error, StopIteration):
        error.add_note("In Prefetch's process:\n" + "".join(traceback.format_exception(error)))
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


# --- Mixing domains: OnlineMixer, learn_late, Mix -------------------------------------------------

class OnlineMixer:
    """Online Data Mixing (Albalak et al., 2023): ``probabilities`` are the ``weights`` until
    ``warmup_steps`` are done, then each ``update`` applies ``variant``'s rule (DESIGN.md 9)."""

    def __init__(self, weights, *, variant="exp3", alpha=0.9, warmup_steps=0):
        if variant not in ("exp3", "smoothed-mean"):
            raise ValueError(f"variant={variant!r}: use 'exp3' or 'smoothed-mean'")
        total = sum(weights)
        self.probabilities = [w / total for w in weights]
        self.rewards = [0.0] * len(weights)
        self.variant, self.alpha, self.warmup_steps = variant, alpha, warmup_steps
        self.config = {"weights": list(weights), "variant": variant, "alpha": alpha,
                       "warmup_steps": warmup_steps}

    def epsilon(self, t):
        k = len(self.rewards)
        return 1 / k if t <= 0 else min(1 / k, math.sqrt(math.log(k) / (k * t)))

    def update(self, losses, step):
        if step <= self.warmup_steps:
            return
        a = self.alpha
        for i, loss in losses.items():
            gain = loss / self.probabilities[i] if self.variant == "exp3" else math.exp(loss)
            self.rewards[i] = a * self.rewards[i] + (1 - a) * gain
        k, eps = len(self.rewards), self.epsilon(step)
        weights = self.rewards  # (smoothed-mean's shares: R_i / sum_j R_j)
        if self.variant == "exp3":
            scaled = [self.epsilon(step - 1) * r for r in self.rewards]
            top = max(scaled)  # softmax without overflow
            weights = [math.exp(x - top) for x in scaled]
        self.probabilities = [(1 - k * eps) * (w / sum(weights)) + eps for w in weights]

    def state_dict(self):
        return {"config": self.config, "probabilities": self.probabilities, "rewards": self.rewards}

    def load_state_dict(self, state):
        if state["config"] != self.config:
            raise ValueError(f"OnlineMixer: the saved state was made with {state['config']}, "
                             f"this mixer has {self.config}")
        self.probabilities, self.rewards = list(state["probabilities"]), list(state["rewards"])


def learn_late(mixer, held, step):
    """A mixer learns from the losses ``held`` of the step before ``step`` (DESIGN.md 9)."""
    if mixer and held and held[0] == step - 1:
        mixer.update({i: loss for i, loss in enumerate(held[1]) if loss is not None}, held[0])


class Mix(Stage):
    """Interleaves named pipelines, each sample's ``domain`` drawn at random (DESIGN.md 9)."""

    def __init__(self, pipelines, weights=None, *, seed=0, mixer=None):
        self.names, self.pipelines = list(pipelines), list(pipelines.values())
        if mixer is None and (weights is None or len(weights) != len(self.names)):
            raise ValueError(f"Mix: give one weight per domain ({self.names}) or a mixer")
        self.weights, self.mixer = weights, mixer
        self.rng = random.Random(seed)
        self.config = {"domains": self.names, "seed": seed}

    @property
    def probabilities(self):
        return self.mixer.probabilities if self.mixer else self.weights

    def __next__(self):
        i = self.rng.choices(range(len(self.names)), weights=self.probabilities)[0]
        sample = next(self.pipelines[i])
        sample["domain"] = i
        return sample

    def state_dict(self):
        return self._state(rng=_rng_to_json(self.rng),
                           upstream=[p.state_dict() for p in self.pipelines],
                           mixer=self.mixer.state_dict() if self.mixer else None)

    def load_state_dict(self, state):
        self._load(state)  # the config (Mix has no src: its upstreams are the domains, below)
        _rng_from_json(self.rng, state["rng"])
        for pipeline, upstream in zip(self.pipelines, state["upstream"]):
            pipeline.load_state_dict(upstream)
        if self.mixer:
            self.mixer.load_state_dict(state["mixer"])

    def reshard_state(self, olds, ctx):
        """Each domain reshards on its own; the mixer's, the same on every rank, goes on."""
        if len({json.dumps(old["mixer"]) for old in olds}) > 1:
            raise ValueError("reshard: the ranks saved different mixer states")
        upstream = [ctx.merge(pipeline, [old["upstream"][d] for old in olds])
                    for d, pipeline in enumerate(self.pipelines)]
        return self._state(rng=ctx.rng(olds), upstream=upstream, mixer=olds[0]["mixer"])


# --- Resuming on another number of ranks: reshard (DESIGN.md section 4) ---------------------------

def _stages(pipeline):
    """The stages of ``pipeline`` from its top, through those of a Mix, Interleave, Concat."""
    stages = [pipeline]
    while stages:
        stage = stages.pop()
        yield stage
        stages += getattr(stage, "pipelines", None) or [stage.src] * bool(stage.src)


def start(pipeline):
    """Forks each Prefetch of ``pipeline`` now, while no other thread runs (DESIGN.md 6)."""
    for stage in _stages(pipeline):
        if isinstance(stage, Prefetch):
            stage._start()


def first_read(pipeline):
    """Has each Prefetch of ``pipeline`` make its first item, raising its error (DESIGN.md 3)."""
    for stage in _stages(pipeline):
        if isinstance(stage, Prefetch):
            stage.peek()


def reshard(pipeline, states):
    """Loads the states of an earlier run's ranks into this rank's ``pipeline`` (DESIGN.md 4)."""
    *_, bottom = _stages(pipeline)  # (through a Mix: its first domain's source)
    # The rank: the highest stage that splits the data by it, a Stride or Files
    split = next((s for s in _stages(pipeline) if isinstance(s, (Stride, Files))), None)
    if split is None:
        raise ValueError(f"reshard: only a pipeline that reads Files, or strides, can move to "
                         f"another number of ranks; this one reads {type(bottom).__name__}")
    ctx = Resharding(split.config["rank"], split.config["world_size"], len(states))
    pipeline.load_state_dict(ctx.merge(pipeline, states))
    return ctx.report


class Resharding:
    """Given to each reshard_state: the rank, world size, ``mine`` and ``report`` (DESIGN.md 4)."""

    def __init__(self, rank, world_size, old_world_size):
        self.rank, self.world_size = rank, world_size
        self.mine = [i for i in range(old_world_size) if i % world_size == rank]
        self.report = {"old_world_size": old_world_size, "sequences_moved": 0, "tokens_moved": 0}

    def merge(self, stage, olds):
        """``stage``'s state on this rank, from the states its old ranks saved (``olds``)."""
        for old in olds:  # the arguments that shape the stream, but where each rank reads
            stage._check_config(old.get("config", {}), ignore=("rank", "world_size"))
        return stage.reshard_state(olds, self)

    def rng(self, olds):
        """A stage's RNG state on this rank: old rank r's goes on (DESIGN.md section 4)."""
        rng = _rng_from_json(random.Random(), olds[self.rank % len(olds)]["rng"])
        if self.rank >= len(olds):
            rng.seed(f"{rng.getrandbits(64)}-{self.rank}")
        return _rng_to_json(rng)


# --- The trainer's wiring: source, sft_format, domains, validation_set, state readers -------------

def source(spec, *, train, rank=0, world_size=1, slots=8, epochs=None, seed=0, sft=False,
           tokenizer=None, skip_bad_records=False, format=None):
    """The documents of a --dataset, as Files or HFDataset (DESIGN.md 10): training's shuffled."""
    required = [] if sft else ["text"]
    local = os.path.exists(spec) or glob.has_magic(spec) or "{" in spec
    name, split = spec, ""
    if not local and "://" not in spec and ":" in spec:
        name, _, split = spec.rpartition(":")
    split = split or ("train" if train else "validation")
    saved = any(os.path.exists(os.path.join(name, f))  # what save_to_disk writes
                for f in ("dataset_info.json", "dataset_dict.json"))
    if not saved and (local or "://" in spec or shard_format(name)):
        if slots % world_size:
            raise DataError(f"--active-shards {slots} is not a multiple of the world size "
                            f"{world_size}: every rank reads whole slots. Pass a multiple of "
                            "it (and keep it on resume: it shapes the data order).")
        check = Tokenize.check_record  # checked in Files, where shard and line are known
        if sft:  # (with the tokenizer: has it the chat template 'messages' need?)
            check = (FormatInstructions(None, tokenizer).check if tokenizer else
                     FormatInstructions.check_record)
        try:
            files = Files(spec, repeat=train, epochs=epochs, shuffle_shards=train, seed=seed,
                          rank=rank, world_size=world_size, required_fields=required,
                          check=check, skip_bad_records=skip_bad_records, format=format,
                          n_active_shards=slots, tokenizer=tokenizer)
            if sft and any(format in TOKEN_FORMATS or shard_format(u) == "tokens"
                           for u in files.urls):
                raise DataError("--task sft reads instructions: a token file holds only ids")
            return files
        except SplitError as e:
            if train:
                raise DataError(f"--dataset {spec}: {e}") from e
            return source(spec, train=False, rank=rank, world_size=world_size,
                          slots=e.n_splits, sft=sft, tokenizer=tokenizer,
                          skip_bad_records=skip_bad_records, format=format)
    import datasets.distributed  # here, not at the top: only these sources need the library
    try:
        if saved:  # a map-style dataset on disk: read by index, so resuming is one lookup
            dataset = datasets.load_from_disk(name)
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[split]
        else:  # streamed from the Hub as it trains; the pipeline's Shuffle shuffles it
            dataset = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # a typo'd local path lands here too: say both readings
        raise DataError(f"{spec!r} is no local file, pattern or URL, and reading it as a "
                        f"Hugging Face dataset (split {split!r}) failed: "
                        f"{type(e).__name__}: {e}") from e
    if world_size > 1:  # whole shards per rank where they divide evenly, else every W-th row
        dataset = datasets.distributed.split_dataset_by_node(dataset, rank, world_size)
    return HFDataset(dataset, repeat=train, epochs=epochs, required_fields=required,
                     shuffle=train and saved, seed=seed)


def sft_format(spec, **source_args):
    """"chat" if the first record that training reads is a conversation, else "instruction"."""
    with source(spec, train=True, sft=True, **source_args) as first:
        record = next(first, {})
    return "chat" if "messages" in record else "instruction"


def find_domains(pattern, like=None):
    """{domain: its shards}: the directories that the first * of ``pattern`` stands for
    ("data/sample/*/train-*.jsonl": code, docstrings, ...); ``like``: the ones they must be."""
    root, _, rest = pattern.partition("/*/")
    if not rest:
        raise DataError(f"--mix/--odm need domains as directories: a --dataset like "
                        f"root/*/shards, not {pattern!r}")
    base = Path(root if os.path.isdir(root) else next(iter(glob.glob(root)), root))  # kit[[]1]
    names = sorted(p.name for p in base.iterdir() if p.is_dir() and any(p.glob(rest)))
    if not names:
        raise DataError(f"--mix/--odm: no directory of {root}/ holds files matching {rest!r}, "
                        f"so {pattern!r} has no domains to mix.")
    if like is not None and names != list(like):
        raise DataError(f"--val-dataset has the domains {names}, --dataset {list(like)}")
    return {name: f"{root}/{glob.escape(name)}/{rest}" for name in names}


def natural_sizes(pattern):
    """{domain: bytes of its files, as stored}: --mix natural's weights (DESIGN.md section 3)."""
    shards = {name: expand_urls(urls) for name, urls in find_domains(pattern).items()}
    packed = {name: [url.endswith(_COMPRESSED) for url in urls] for name, urls in shards.items()}
    if len({flag for flags in packed.values() for flag in flags}) > 1:
        log.warning("--mix natural weighs the domains by their files' bytes as stored, and the "
                    "shards of %s are compressed, others not: compressed text weighs 3 to 10 "
                    "times less than it reads. Give the weights (--mix NAME=W,...) instead.",
                    ", ".join(name for name, flags in packed.items() if any(flags)))
    return {name: sum(map(os.path.getsize, urls)) for name, urls in shards.items()}


def validation_set(pipelines, n, train_spec, val_spec, tagged=False, warn=True, asked=None):
    """The first ``n`` batches of each pipeline, which it closes (``tagged``: with its index as
    "domain"); refuses none, warns (``warn``) of fewer than ``asked`` and of shared shards."""
    batches = []
    for i, pipeline in enumerate(pipelines):
        for batch in itertools.islice(pipeline, n):
            tag = {"domain": torch.full((len(batch["input_ids"]),), i)} if tagged else {}
            batches.append(batch | tag)
        pipeline.close()
    if not batches:
        raise DataError(f"--val-dataset {val_spec} has less than one batch of tokens "
                        "(--batch-size x --seq-length): lower --batch-size, or pass a bigger "
                        "--val-dataset.")
    if not warn:
        return batches
    if len(batches) < (asked or 0) * len(pipelines):
        log.warning(f"--val-dataset holds only {len(batches)} batches of the "
                    f"{asked * len(pipelines)} asked for: validating on those")
    try:
        train_urls, val_urls = expand_urls(train_spec), expand_urls(val_spec)
    except OSError:  # not shards (a Hub name): nothing to compare
        return batches
    shared = set(train_urls) & set(val_urls)
    if all(map(shard_format, train_urls + val_urls)) and shared:  # (Files reads them)
        log.warning(f"{len(shared)} shard(s) are in both --dataset and --val-dataset (e.g. "
                    f"{sorted(shared)[0]}): the validation loss will look better than it is")
    return batches


def counters(loader_state, into=None):
    """A pipeline's counts, summed over its stages: Files' "skipped", ``counters`` (DESIGN.md 2)."""
    into = {} if into is None else into
    for state in loader_state if isinstance(loader_state, list) else [loader_state]:  # (Mix)
        if isinstance(state, dict):
            own = {"skipped": state.get("skipped", 0), **state.get("counters", {})}
            into |= {name: into.get(name, 0) + n for name, n in own.items()}
            counters(state.get("upstream"), into)
    return into


def source_epoch(loader_state):
    """The epoch that a pipeline's source is in (pass over its shards; Mix's: the smallest)."""
    upstream = loader_state.get("upstream")
    if upstream is None:
        return loader_state["epoch"]
    if isinstance(upstream, list):
        return min(source_epoch(state) for state in upstream)
    return source_epoch(upstream)


# --- Stages only users call (Map, ..., Concat), then the chained face: CheckpointableDataset ------

class Map(Stage):
    """Applies ``fn`` to every sample. ``fn`` must be deterministic for resume to be exact."""

    def __init__(self, src, fn):
        self.src, self.fn = src, fn

    def __next__(self):
        return self.fn(next(self.src))


class Filter(Map):
    """Keeps the samples for which ``fn`` is true."""

    def __next__(self):
        while True:
            sample = next(self.src)
            if self.fn(sample):
                return sample


_END = object()  # (no sample: the end)


class FilterMap(Map):
    """Applies ``fn``; a sample for which it returns None is dropped."""

    def __next__(self):
        while (sample := self.fn(next(self.src))) is None:
            pass
        return sample


class ParallelMap(Stage):
    """FilterMap on threads or processes, samples ahead (DESIGN.md 2, rule 1, and its table)."""

    def __init__(self, src, fn, *, max_workers=None, prefetch_factor=10, ordered=True,
                 executor_type="process"):
        pools = {"thread": ThreadPoolExecutor, "process": functools.partial(
            concurrent.futures.ProcessPoolExecutor, initializer=_die_with_parent)}
        if executor_type not in pools:
            raise ValueError(f"executor_type={executor_type!r}: pass 'thread' or 'process'")
        self.src, self.fn, self.ordered, self.pool = src, fn, ordered, pools[executor_type]
        self.workers = max_workers or os.cpu_count()
        self.ahead = self.workers * prefetch_factor
        self.config = {"ordered": ordered}
        self._pool, self._inflight, self._exhausted = None, [], False
        self._last = None  # the upstream state after the last sample handed out

    def __next__(self):
        if self._last is None:
            self._last = self.src.state_dict()
        while True:
            while not self._exhausted and len(self._inflight) < self.ahead:
                if (sample := next(self.src, _END)) is _END:
                    self._exhausted = True
                    break
                self._pool = self._pool or self.pool(self.workers)
                self._inflight.append((self._pool.submit(self.fn, sample), self.src.state_dict()))
            if not self._inflight:
                raise StopIteration
            done = (k for k, (future, _) in enumerate(self._inflight) if future.done())
            future, self._last = self._inflight.pop(0 if self.ordered else next(done, 0))
            if (sample := future.result()) is not None:
                return sample

    def state_dict(self):
        return self._state(upstream=self.src.state_dict() if self._last is None else self._last)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._inflight = []
        super().close()


class Sequence(Stage):
    """In-memory samples read by index, in order or shuffled; ``iterable``: DESIGN.md 2's table."""

    def __init__(self, items, *, repeat=False, shuffle=False, seed=0, iterable=False):
        if not iterable and not hasattr(items, "__getitem__"):
            items = list(items)
        if iterable and shuffle:
            raise ValueError("Sequence: an iterable cannot be shuffled; give a list")
        self.items, self.iterable = items, iterable
        self.repeat, self.shuffle, self.seed = repeat, shuffle, seed
        self.config = {"n_items": None if iterable else len(items), "repeat": repeat,
                       "shuffle": shuffle, "seed": seed}
        self.epoch, self.pos, self._it, self._order = 0, 0, None, (None, None)

    def __next__(self):
        while (item := self._item()) is _END:
            if not self.repeat or self.pos == 0:  # (an empty epoch: no next one either)
                raise StopIteration
            self.epoch, self.pos, self._it = self.epoch + 1, 0, None
        self.pos += 1
        # A copy, because later stages add keys and the next epoch must see the original.
        return dict(item) if isinstance(item, dict) else item

    def _item(self):
        if self.iterable:
            if self._it is None:  # (resumed: pass what was read before)
                self._it = itertools.islice(iter(self.items), self.pos, None)
            return next(self._it, _END)
        if self._order[0] != self.epoch:  # derived from (seed, epoch), as Files' is: not saved
            self._order = (self.epoch, _split_order(len(self.items), self.seed, self.epoch,
                                                    self.shuffle))
        return self.items[self._order[1][self.pos]] if self.pos < len(self.items) else _END

    def state_dict(self):
        return self._state(epoch=self.epoch, pos=self.pos)

    def load_state_dict(self, state):
        self._load(state)
        self.epoch, self.pos, self._it = state["epoch"], state["pos"], None


class Chunk(Stage):
    """Cuts each document on its own into ``length`` tokens; the uncut rest is state."""

    def __init__(self, src, length, *, drop_remainder=True):
        self.src, self.length, self.drop_remainder = src, length, drop_remainder
        self.config = {"length": length, "drop_remainder": drop_remainder}
        self.doc, self.pos = array.array("q"), 0  # current document, start of its uncut rest

    def __next__(self):
        while True:
            left = len(self.doc) - self.pos
            if left >= self.length or (left > 0 and not self.drop_remainder):
                piece = self.doc[self.pos:self.pos + self.length]
                self.pos += len(piece)
                return {"input_ids": as_tensor(piece)}
            self.doc, self.pos = array.array("q"), 0
            self.doc.frombytes(as_int64(next(self.src)["input_ids"], "Chunk"))

    def state_dict(self):
        return self._state(rest=self.doc[self.pos:].tolist())

    def load_state_dict(self, state):
        self._load(state)
        self.doc, self.pos = array.array("q", state["rest"]), 0


class Count(Stage):
    """The first ``max_count`` samples (None: all), numbered from 0 in ``column`` if given."""

    def __init__(self, src, max_count=None, *, column=None):
        self.src, self.max_count, self.column, self.count = src, max_count, column, 0
        self.config = {"max_count": max_count, "column": column}

    def __next__(self):
        if self.max_count is not None and self.count >= self.max_count:
            raise StopIteration
        sample = next(self.src)
        if self.column is not None:
            sample[self.column] = self.count
        self.count += 1
        return sample

    def state_dict(self):
        return self._state(count=self.count)

    def load_state_dict(self, state):
        self._load(state)
        self.count = state["count"]


class Stride(Count):
    """Every ``interval``-th sample from the ``offset``-th, read in blocks (DESIGN.md section 4)."""

    def __init__(self, src, interval, offset):
        if not 0 <= offset < interval:
            raise ValueError(f"Stride: offset={offset} must be in [0, interval={interval})")
        self.src, self.interval, self.offset = src, interval, offset
        self.config = {"world_size": interval, "rank": offset}  # (the names reshard changes)
        self.count = 0  # upstream samples read: the same on every rank at a step's end

    def __next__(self):
        sample = _END
        for i in range(self.interval):  # the whole block, so that ranks read in step
            if (item := next(self.src, _END)) is _END:
                break
            sample, self.count = item if i == self.offset else sample, self.count + 1
        if sample is _END:
            raise StopIteration
        return sample

    def reshard_state(self, olds, ctx):
        """Ranks that stopped in step read the same samples: the new ones read on from there."""
        if len(counts := {old["count"] for old in olds}) > 1:
            raise ValueError(f"reshard: the ranks stopped at different places of the stream "
                             f"they stride over (samples read: {sorted(counts)}); resume on "
                             f"{len(olds)} ranks")
        return self._state(count=olds[0]["count"], upstream=olds[0]["upstream"])


class Cache(Stage):
    """The samples of ``build()``, kept in ``store`` as first read (DESIGN.md 2, its table)."""

    def __init__(self, build, store):
        self.build, self.store, self.index, self._at = build, store, 0, -1

    @property
    def config(self):  # the upstream's state at its start: a state loads only into the same data
        if "config" not in self.store:
            with self.build() as fresh:
                self.store["config"] = {"upstream": _crc(json.dumps(fresh.state_dict()))}
        return self.store["config"]

    def __next__(self):
        items = self.store.setdefault("items", [])
        while self.index >= len(items):
            if self.store.get("done"):
                raise StopIteration
            if self._at != len(items):  # another pipeline read on: start where the store ends
                self.close()
                self.src = self.build()
                if items:
                    self.src.load_state_dict(copy.deepcopy(self.store["state"]))
            try:
                items.append(next(self.src))
            except StopIteration:
                self.store["done"] = True
                continue
            self.store["state"], self._at = self.src.state_dict(), len(items)
        self.index += 1
        return dict(items[self.index - 1])  # (a copy: later stages add keys)

    def state_dict(self):
        return self._state(index=self.index, upstream=None)

    def load_state_dict(self, state):
        self._check_config(state["config"])
        self.index = state["index"]


class _Several(Stage):
    """What Interleave and Concat share: several pipelines, and an ``index`` into them."""

    def state_dict(self):
        return self._state(index=self.index, upstream=[p.state_dict() for p in self.pipelines])

    def load_state_dict(self, state):
        self._load(state)
        self.index = state["index"]
        for pipeline, upstream in zip(self.pipelines, state["upstream"]):
            pipeline.load_state_dict(upstream)

    def reshard_state(self, olds, ctx):
        """Each pipeline reshards on its own, as Mix's domains do."""
        upstream = [ctx.merge(pipeline, [old["upstream"][k] for old in olds])
                    for k, pipeline in enumerate(self.pipelines)]
        return self._state(index=self._merged(olds, ctx), upstream=upstream)


class Interleave(_Several):
    """Samples of ``pipelines`` in the proportions of ``weights``, in a fixed order (DESIGN 2)."""

    def __init__(self, pipelines, weights=None, *, chunk_size=1024):
        weights = [1] * len(pipelines) if weights is None else list(weights)
        if len(weights) != len(pipelines) or sum(weights) <= 0 or min(weights) < 0:
            raise ValueError(f"interleave: {len(pipelines)} pipelines need as many weights "
                             f"of 0 or more, not all 0; got {weights}")
        self.pipelines, self.index = list(pipelines), 0
        self.config = {"weights": weights, "chunk_size": chunk_size}
        credit, self.order = [0.0] * len(weights), []
        for _ in range(chunk_size):  # each draw: every credit grows by its share, the largest
            credit = [c + w / sum(weights) for c, w in zip(credit, weights)]  # is drawn and
            self.order.append(credit.index(max(credit)))                      # pays 1
            credit[self.order[-1]] -= 1

    def __next__(self):
        i = self.order[self.index % len(self.order)]
        sample = next(self.pipelines[i])
        self.index += 1
        return sample

    def _merged(self, olds, ctx):
        return olds[ctx.rank % len(olds)]["index"]


class Concat(_Several):
    """The samples of each pipeline in turn."""

    def __init__(self, pipelines):
        if not pipelines:
            raise ValueError("concat: give at least one pipeline")
        self.pipelines, self.index = list(pipelines), 0
        self.config = {"n_pipelines": len(self.pipelines)}

    def __next__(self):
        while self.index < len(self.pipelines):
            try:
                return next(self.pipelines[self.index])
            except StopIteration:
                self.index += 1
        raise StopIteration

    def _merged(self, olds, ctx):
        return min(old["index"] for old in olds)  # (a rank past a pipeline finds it empty)


# -- The chained face: epochraft's API over the stages above (README, "Using data.py on its own")

class CheckpointableDataset(torch.utils.data.IterableDataset):
    """A recipe for a pipeline, chained with epochraft's names (DESIGN.md 2, "The chained face")."""

    def __init__(self, build):
        self.build = build  # () -> a fresh pipeline

    def iter(self, state_dict=None):
        pipeline = self.build()
        if state_dict is not None:
            pipeline.load_state_dict(copy.deepcopy(state_dict))  # (stages keep parts of it)
        return pipeline

    def __iter__(self):
        return self.iter()

    def then(self, stage, *args, **kwargs):
        """This dataset followed by ``stage(upstream, *args, **kwargs)``."""
        return CheckpointableDataset(lambda: stage(self.build(), *args, **kwargs))

    @staticmethod
    def from_files(urls, repeat=False, shuffle_shards=False, format="auto", n_active_shards=10,
                   n_standby_shards=2, timeout=60.0, n_prefetch_samples=10, seed=42, **files):
        """Files, up to ``n_active_shards`` slots, a multiple of the world size (DESIGN.md 2)."""
        world = files.get("world_size", 1)
        most = max(1, n_active_shards // world) * world

        def build(slots=most):
            try:
                return Files(urls, repeat=repeat, shuffle_shards=shuffle_shards, seed=seed,
                             format=None if format == "auto" else format, n_active_shards=slots,
                             n_standby_shards=n_standby_shards, standby_timeout=timeout,
                             n_prefetch_samples=n_prefetch_samples, **files)
            except SplitError as e:
                if not e.n_splits // world or slots == e.n_splits // world * world:
                    raise
                return build(e.n_splits // world * world)
        return CheckpointableDataset(build)

    @staticmethod
    def from_sequence(sequence, repeat=False, shuffle=False, shuffle_seed=42):
        return CheckpointableDataset(lambda: Sequence(sequence, repeat=repeat, shuffle=shuffle,
                                                      seed=shuffle_seed))

    @staticmethod
    def from_iterable(iterable, repeat=False):
        return CheckpointableDataset(lambda: Sequence(iterable, repeat=repeat, iterable=True))

    def map(self, fn):
        return self.then(Map, fn)

    def filter(self, fn):
        return self.then(Filter, fn)

    def filter_map(self, fn):
        return self.then(FilterMap, fn)

    def parallel_filter_map(self, fn, max_workers=None, prefetch_factor=10, ordered=True,
                            executor_type="process"):
        return self.then(ParallelMap, fn, max_workers=max_workers, ordered=ordered,
                         prefetch_factor=prefetch_factor, executor_type=executor_type)

    def parallel_map(self, fn, max_workers=None, prefetch_factor=10, ordered=True,
                     executor_type="process"):
        return self.parallel_filter_map(fn, max_workers, prefetch_factor, ordered, executor_type)

    def parallel_filter(self, fn, max_workers=None, prefetch_factor=10, ordered=True,
                        executor_type="process"):
        return self.parallel_filter_map(functools.partial(_kept, fn), max_workers,
                                        prefetch_factor, ordered, executor_type)

    def tokenize(self, tokenizer, tokenizer_kwargs=None, target_column="text", parallel=True,
                 max_workers=1, prefetch_factor=10, ordered=True, executor_type="thread"):
        """Tokenize on ``max_workers`` threads, in order (DESIGN.md section 2, the verbs' table)."""
        kwargs = dict(tokenizer_kwargs or {})
        special = kwargs.pop("add_special_tokens", True)
        _refuse("tokenize", kwargs and f"tokenizer_kwargs {sorted(kwargs)}",
                executor_type != "thread" and "executor_type='process'")
        return self.then(Tokenize, tokenizer, column=target_column, add_special_tokens=special,
                         num_threads=(max_workers or 1) if parallel else 1)

    def ensure_bos_eos(self, tokenizer, target_column="input_ids"):
        _refuse("ensure_bos_eos", target_column != "input_ids" and f"column {target_column!r}")
        return self.then(EnsureBosEos, tokenizer)

    def chunk(self, chunk_length, target_columns=("input_ids",), drop_remainder=True):
        _refuse("chunk", tuple(target_columns) != ("input_ids",) and f"{target_columns}")
        return self.then(Chunk, chunk_length, drop_remainder=drop_remainder)

    def concat_chunk(self, chunk_length, target_columns=("input_ids",)):
        _refuse("concat_chunk", tuple(target_columns) != ("input_ids",) and f"{target_columns}")
        return self.then(ConcatChunk, chunk_length)

    def pad(self, pad_values, chunk_length):
        """Pad: ``pad_values`` gives input_ids' pad id (and labels', -100 if not given)."""
        _refuse("pad", set(pad_values) - {"input_ids", "labels"} and f"columns {pad_values}")
        return self.then(Pad, chunk_length, pad_id=pad_values["input_ids"],
                         label_pad_id=pad_values.get("labels", -100))

    def pack_chunk(self, chunk_length, target_columns=("input_ids",), discard_long_samples=False):
        _refuse("pack_chunk", set(target_columns) - {"input_ids", "labels"} and
                f"columns {target_columns}")
        return self.then(Pack, chunk_length, discard_long=discard_long_samples)

    def shuffle(self, buffer_size, seed=42):
        return self.then(Shuffle, buffer_size, seed=seed)

    def batch(self, batch_size, collate_fn=collate, drop_last=False):
        return self.then(Batch, batch_size, drop_last=drop_last, collate_fn=collate_fn)

    def take(self, max_count):
        return self.then(Count, max_count)

    def enumerate(self, count_column="step"):
        return self.then(Count, column=count_column)

    def stride(self, interval, offset):
        return self.then(Stride, interval, offset)

    def cache(self):
        store = {}  # (shared by every pipeline this dataset builds)
        return CheckpointableDataset(lambda: Cache(self.build, store))

    def __add__(self, other):
        return concat_datasets([self, other])


def _kept(fn, sample):
    return sample if fn(sample) else None


def _refuse(verb, *unsupported):
    """A ValueError for what a verb of the face does not do here, named."""
    if said := [u for u in unsupported if u]:
        raise ValueError(f"{verb}: {', '.join(said)} not supported by data.py's stages; "
                         "chain a map() of your own, or then(YourStage)")


def interleave_datasets(sources, weights=None, chunk_size=1024):
    """Samples of ``sources`` in the proportions of ``weights`` (Interleave; Mix draws them)."""
    return CheckpointableDataset(lambda: Interleave([s.build() for s in sources], weights,
                                                    chunk_size=chunk_size))


def concat_datasets(sources):
    return CheckpointableDataset(lambda: Concat([s.build() for s in sources]))
