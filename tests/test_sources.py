"""Sources beyond local JSONL: S3 and HTTP (real servers on 127.0.0.1), Parquet, HF datasets.

The S3 server is moto's, spoken to through boto3 + smart_open exactly as a real bucket would
be. The HTTP server is ours, so that it can serve byte ranges and misbehave on cue: answer
503, or cut a response off in the middle.
"""

import functools
import gzip
import http.server
import json
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import cbor2
import datasets
import pyarrow
import pyarrow.parquet
import pytest
import zstandard
from helpers import (
    ROOT,
    Count,
    examples,
    global_step,
    last_step,
    metrics,
    run_with_cuts,
    stage,
    start,
    train,
    train_args,
    trainer_pipeline,
    wait_for,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from moto.server import ThreadedMotoServer

import data
from data import DataError, Files, HFDataset

BUCKET = "kit-data"


def cbor_bytes(records):
    return b"".join(map(cbor2.dumps, records))


def jsonl_bytes(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def documents(n, seed=0, size=40):
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choices("abcdefgh", k=rng.randrange(1, size))), "doc": i}
            for i in range(n)]


def parquet_bytes(records, row_group_size):
    sink = pyarrow.BufferOutputStream()
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), sink,
                                row_group_size=row_group_size)
    return sink.getvalue().to_pybytes()


# -- S3 (moto) -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3():
    """A boto3 client of a real S3 API server on loopback, with a record of every GetObject:
    [Content-Range, bytes the client read of the body]."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket=BUCKET)
    client.fetched = []

    def count_body_bytes(parsed, **_):
        if "Body" not in parsed:  # an error answer
            return
        entry, read = [parsed.get("ContentRange"), 0], parsed["Body"].read
        client.fetched.append(entry)

        def counted(*args, **kwargs):
            chunk = read(*args, **kwargs)
            entry[1] += len(chunk)
            return chunk
        parsed["Body"].read = counted

    client.meta.events.register("after-call.s3.GetObject", count_body_bytes)
    yield client
    server.stop()


def put(s3, key, body):
    s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    return f"s3://{BUCKET}/{key}"


def test_s3_stream_cut_resume_equal_local(s3, tmp_path):
    shards = [documents(30, 1), documents(17, 2), documents(25, 3)]
    shards.append(documents(40, 4, size=200))
    bodies = [jsonl_bytes(shards[0]), zstandard.ZstdCompressor().compress(jsonl_bytes(shards[1])),
              parquet_bytes(shards[2], row_group_size=7), cbor_bytes(shards[3])]
    names = ["s3-a.jsonl", "s3-b.jsonl.zst", "s3-c.parquet", "s3-d.cbor"]
    local = []
    for name, body in zip(names, bodies):
        (tmp_path / name).write_bytes(body)
        local.append(str(tmp_path / name))
    remote = [put(s3, name, body) for name, body in zip(names, bodies)]
    args = dict(n_active_shards=2, repeat=True, epochs=2, shuffle_shards=True, seed=3)
    expected = list(Files(local, **args))
    assert len(expected) == 2 * 112
    make = lambda: Files(remote, transport_params={"client": s3}, **args)  # noqa: E731
    assert run_with_cuts(make, [], 250) == expected
    assert run_with_cuts(make, [1, 40, 97, 143, 201], 250) == expected
    s3.fetched.clear()  # a CBOR shard is read in one request, not one a record
    assert len(list(Files(remote[3], transport_params={"client": s3}))) == 40
    assert len(s3.fetched) == 1


def test_s3_resume_is_a_range_read(s3):
    """Resuming near the end of a 20 MB shard downloads one read buffer from the offset on."""
    body = jsonl_bytes([{"text": "x" * 1000, "i": i} for i in range(20_000)])
    url = put(s3, "big.jsonl", body)
    for cut in (200, 19_800):  # 1% and 99% of the shard: the same cost
        files = Files(url, transport_params={"client": s3})
        for _ in range(cut):
            next(files)
        state = json.loads(json.dumps(files.state_dict()))
        files.close()
        s3.fetched.clear()
        resumed = Files(url, transport_params={"client": s3})
        resumed.load_state_dict(state)
        assert next(resumed)["i"] == cut
        resumed.close()
        # From the start of the line read last, which is checked (a changed shard is refused).
        offset = state["slots"][0]["offset"] - state["slots"][0]["last"][0]
        downloaded = sum(n for _, n in s3.fetched)
        assert downloaded <= 0.01 * len(body), (cut, s3.fetched)
        assert [r for r, _ in s3.fetched] == [f"bytes {offset}-{len(body) - 1}/{len(body)}"]


def test_s3_bad_input_names_the_url(s3):
    with pytest.raises(FileNotFoundError, match=f"shard s3://{BUCKET}/nothing-here.jsonl does "
                                                "not exist.*NoSuchKey"):
        next(Files(f"s3://{BUCKET}/nothing-here.jsonl", transport_params={"client": s3}))
    cut = gzip.compress(jsonl_bytes(documents(3000)))
    url = put(s3, "cut.jsonl.gz", cut[: len(cut) // 2])
    with pytest.raises(OSError, match=rf"shard {url}: read failed after line \d+"):
        list(Files(url, transport_params={"client": s3}))
    url = put(s3, "no-text.parquet", parquet_bytes([{"body": "a"}], 10))
    with pytest.raises(DataError, match=rf"shard {url}: no column\(s\) \['text'\]; it has "
                                        r"\['body'\]"):
        next(Files(url, required_fields=["text"], transport_params={"client": s3}))


# -- HTTP with faults ------------------------------------------------------------------------------

class FaultyHTTPServer(http.server.ThreadingHTTPServer):
    """Serves ``files`` ({path: bytes}) with Range support. ``faults`` says what to do to the
    next requests, one entry each: None (answer well), a status code, or ("drop", n): send the
    headers and only n bytes of the body, then close the connection. ``cap``: a range answer
    holds at most that many bytes (as some servers and CDNs cut them), the rest asked again.
    ``budget``: the body bytes it sends in all before it stops answering (``stalled`` is then
    set), as a hung server does, until ``resume`` is set; then it hangs up."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FaultyHandler)
        self.files, self.faults, self.requests, self.cap, self.budget = {}, [], [], None, None
        self.lock, self.stalled, self.resume = threading.Lock(), threading.Event(), None

    def url(self, path):
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is fine
            super().handle_error(request, client_address)


class FaultyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        server = self.server
        with server.lock:
            fault = server.faults.pop(0) if server.faults else None
            server.requests.append((self.path, self.headers.get("Range")))
        body = server.files.get(self.path)
        if isinstance(fault, int) or body is None:
            self.send_response(fault if isinstance(fault, int) else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, start, end = 200, 0, len(body)
        if match := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or ""):
            status, start = 206, int(match[1])
            end = int(match[2]) + 1 if match[2] else len(body)
            end = min(end, start + server.cap) if server.cap else end
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.end_headers()
        part = body[start:end] if fault is None else body[start:end][:fault[1]]
        with server.lock:
            sent = len(part) if server.budget is None else min(len(part), server.budget)
            server.budget = None if server.budget is None else server.budget - sent
        try:
            self.wfile.write(part[:sent])
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading (it seeked, or closed the shard)
        if sent < len(part):
            server.stalled.set()
            server.resume.wait(300)
        if fault is not None or sent < len(part):
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    server = FaultyHTTPServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    if server.resume:
        server.resume.set()
    server.shutdown()
    server.server_close()


@pytest.fixture()
def web_shards(web):
    shards = {"/a.jsonl": jsonl_bytes(documents(40, 4, size=300)),
              "/b.jsonl.gz": gzip.compress(jsonl_bytes(documents(30, 5, size=300))),
              "/c.jsonl": jsonl_bytes(documents(35, 6, size=300)),
              "/d.parquet": parquet_bytes(documents(20, 7, size=300), row_group_size=6),
              "/e.cbor": cbor_bytes(documents(25, 8, size=300))}
    web.files.update(shards)
    web.faults.clear()
    web.budget, web.resume, web.stalled = None, threading.Event(), threading.Event()
    return [web.url(path) for path in shards]


faults = st.lists(st.one_of(st.none(), st.sampled_from([500, 502, 503]),
                            st.tuples(st.just("drop"), st.integers(0, 12_000))), max_size=12)


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=faults, cuts=st.lists(st.integers(0, 150), max_size=2))
@example(schedule=[None] * 6 + [("drop", 2)], cuts=[])  # (inside a CBOR record: retried)
def test_http_faults_and_cuts_leave_the_stream_unchanged(web, web_shards, schedule, cuts):
    make = lambda: Files(web_shards, n_active_shards=2, retries=30, retry_delay=0)  # noqa: E731
    web.faults.clear()
    clean = run_with_cuts(make, [], 200)
    assert len(clean) == 150
    web.faults[:] = schedule
    assert run_with_cuts(make, cuts, 200) == clean


def test_http_resume_asks_for_the_offset_in_one_request(web, web_shards):
    files = Files(web_shards[0])
    for _ in range(30):
        next(files)
    state = files.state_dict()
    files.close()
    web.requests.clear()
    resumed = Files(web_shards[0])
    resumed.load_state_dict(state)
    assert next(resumed)["doc"] == 30
    slot = state["slots"][0]  # from the start of the line read last, which is checked
    assert web.requests == [("/a.jsonl", f"bytes={slot['offset'] - slot['last'][0]}-")]


def test_a_resume_from_a_server_that_cuts_its_range_answers_reads_every_record(web, web_shards):
    """Answers of at most 2,000 bytes: the ranged open does not hold the rest of the shard, so
    smart_open's seek asks for it, piece by piece; the records are those of a straight read."""
    clean = [r["doc"] for r in Files(web_shards[0])]
    files = Files(web_shards[0])
    for _ in range(10):
        next(files)
    state = files.state_dict()
    files.close()
    web.cap = 2000
    try:
        resumed = Files(web_shards[0])
        resumed.load_state_dict(state)
        assert [r["doc"] for r in resumed] == clean[10:]
    finally:
        web.cap = None


def test_a_connection_dropped_after_a_resume_reopens_at_the_line_read_last(web, web_shards):
    """The reopen checks the line read just before the drop, not the one the state named."""
    make = lambda: Files(web_shards[0], retries=3, retry_delay=0)  # noqa: E731
    web.faults.clear()
    clean = [r["doc"] for r in make()]
    files = make()
    for _ in range(5):
        next(files)
    state = files.state_dict()
    files.close()
    web.faults[:] = [("drop", 3000)]  # (opened at the offset: ~9 lines, then dropped)
    resumed = make()
    resumed.load_state_dict(state)
    assert [r["doc"] for r in resumed] == clean[5:]
    assert not web.faults  # (the drop happened)


def test_http_retries_then_fails_naming_the_url(web, web_shards, caplog):
    web.faults[:] = [503] * 10
    with pytest.raises(OSError, match=f"shard {web_shards[0]}: still failing after 3 retries"):
        next(Files(web_shards[0], retries=3, retry_delay=0))
    assert caplog.text.count("retry") == 3


def test_a_server_that_never_answers_times_out_and_is_named(monkeypatch):
    silent = socket.socket()  # accepts connections (the kernel does) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/x.jsonl"
    monkeypatch.setattr(data, "HTTP_TIMEOUT", (0.5, 0.5))
    try:
        with pytest.raises(OSError, match=f"shard {url}: still failing after 1 retries"):
            next(Files(url, n_active_shards=1, retries=1, retry_delay=0))
    finally:
        silent.close()


def test_retries_stop_after_their_time_whatever_fills_it(monkeypatch):
    """A silent server: each attempt waits out the read timeout. 1,000 retries of 0.3 s would
    take 5 minutes; RETRY_TIME (1 s here) ends them after a few, naming the time spent."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/x.jsonl"
    monkeypatch.setattr(data, "HTTP_TIMEOUT", (0.3, 0.3))
    monkeypatch.setattr(data, "RETRY_TIME", 1)
    began = time.monotonic()
    try:
        with pytest.raises(OSError, match=r"still failing after [1-9] retries in [01] s"):
            next(Files(url, n_active_shards=1, retries=1000, retry_delay=0))
    finally:
        silent.close()
    assert time.monotonic() - began < 30


def test_an_http_server_that_stops_answering_mid_read_fails_it_in_the_retry_time(
        web, web_shards, monkeypatch):
    monkeypatch.setattr(data, "HTTP_TIMEOUT", (0.5, 0.5))
    monkeypatch.setattr(data, "RETRY_TIME", 2)
    web.budget = 3000  # (a few lines of the first answer, then nothing: every read waits)
    began = time.monotonic()
    with pytest.raises(OSError, match=f"shard {web_shards[0]}: still failing after [1-9] "):
        list(Files(web_shards[0], retry_delay=0.1))
    assert web.stalled.is_set() and time.monotonic() - began < 15


@pytest.mark.parametrize("url", ["s3://kit-data/shards/*.jsonl", "gs://b/train-[0-3].jsonl",
                                 "http://127.0.0.1:9/shards/*.jsonl"])  # (port 9: closed)
def test_a_glob_in_a_remote_url_is_refused_at_once_with_the_way_out(url):
    began = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"not globbed; name shards with \{a,b\}"):
        Files(url)
    assert time.monotonic() - began < 5  # (no request, so no retries)
    assert data.expand_urls("http://[::1]:8000/a.jsonl") == ["http://[::1]:8000/a.jsonl"]


def main_thread_waits(pid):
    """Whether a process's main thread sleeps in a read or poll syscall (Linux x86-64 and
    arm64): how a trainer whose loader waits for a batch looks from outside."""
    waits = {"x86_64": {"0", "7", "271"}, "aarch64": {"63", "73"}}[platform.machine()]
    return Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()[0] in waits


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64") or not sys.platform.startswith(
    "linux"), reason="reads the main thread's syscall from /proc")
def test_a_signal_stops_a_run_whose_loader_waits_on_a_hung_server(web, tiny_model, tmp_path):
    """SIGTERM while the data loader waits on a read that never ends: within seconds the run
    saves the last step it took and exits 0; once the server answers again, the resumed run
    trains the very steps of a run that never stopped."""
    docs = documents(2000, 9, size=400)
    web.files["/hung.jsonl"] = jsonl_bytes(docs)
    common = dict(dataset=web.url("/hung.jsonl"), active_shards=1, shuffle_buffer=1,
                  batch_size=16, max_steps=1000, ckpt_freq=1000, log_freq=1,
                  min_lr=1e-2)  # (= --lr: the schedule does not depend on --max-steps)
    web.budget, web.resume, web.stalled = 200_000, threading.Event(), threading.Event()
    exp_dir, log = tmp_path / "hung", tmp_path / "log.txt"
    proc = start(train_args(tmp_path, tiny_model, name="hung", **common), log)
    try:
        wait_for(lambda: web.stalled.is_set() and last_step(exp_dir) > 1 and
                 main_thread_waits(proc.pid), proc)
        wait_for(lambda: main_thread_waits(proc.pid), proc)  # (still: not a passing read)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        proc.kill()
        web.resume.set()
    text, taken = log.read_text(), global_step(exp_dir)
    assert f"waited on a read: saving step {taken}" in text and taken > 1, text
    assert (exp_dir / f"checkpoints/step-{taken:06d}").is_dir()
    web.budget, more = None, dict(common, max_steps=taken + 3)
    assert train(train_args(tmp_path, tiny_model, name="hung", **more)).returncode == 0
    assert train(train_args(tmp_path, tiny_model, name="straight", **more)).returncode == 0
    keys = ("step", "loss", "grad_norm", "lr")
    assert ([[row.get(k) for k in keys] for row in metrics(exp_dir)] ==
            [[row.get(k) for k in keys] for row in metrics(tmp_path / "straight")])


@pytest.fixture()
def stoppable_s3(monkeypatch):
    """A moto S3 server in a process of its own (SIGSTOP stops it answering, as a hung
    server does), found by boto3 as a user's endpoint is: (its Popen, a boto3 client)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for name, value in {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
                        "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    for _ in range(300):  # until it answers (it starts in about a second)
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            assert proc.poll() is None, "moto's server did not start"
            time.sleep(0.05)
    yield proc, client
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_an_s3_server_that_stops_answering_mid_read_fails_it_in_the_retry_time(
        stoppable_s3, monkeypatch):
    """One owner of timeouts and retries: boto3's and smart_open's own do not run inside the
    kit's, so a read of a hung server fails in about RETRY_TIME plus a read timeout or two
    (here 1 s each), naming the object, not after minutes of nested retries."""
    proc, client = stoppable_s3
    url = put(client, "big.jsonl", jsonl_bytes([{"text": "x" * 1000, "i": i}
                                                for i in range(30_000)]))
    monkeypatch.setattr(data, "HTTP_TIMEOUT", (1, 1))
    monkeypatch.setattr(data, "RETRY_TIME", 3)
    # (with a user's own S3.Client arguments, which must not drop the kit's timeouts)
    files = Files(url, n_active_shards=1, retry_delay=0.1, transport_params={
        "client_kwargs": {"S3.Client": {"region_name": "us-east-1"}}})
    assert [next(files)["i"] for _ in range(100)] == list(range(100))
    proc.send_signal(signal.SIGSTOP)  # (30 MB: most of the answer is still to come)
    began = time.monotonic()
    with pytest.raises(OSError, match=f"shard {url}: still failing after [1-9] retries"):
        for _ in range(30_000):
            next(files)
    assert time.monotonic() - began < 20


def test_a_server_without_range_requests_is_named_with_the_way_out(tmp_path):
    (tmp_path / "one.jsonl").write_bytes(jsonl_bytes(documents(40, 1, size=300)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.log_message = lambda *args: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/one.jsonl"
    try:  # two slots: the second reads from the middle of the file
        with pytest.raises(OSError, match="ignores HTTP Range requests.*python -m http.server"):
            list(Files(url, n_active_shards=2, retries=0))
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status, error, words", [(404, FileNotFoundError, "does not exist"),
                                                  (403, PermissionError, "access denied")])
def test_http_permanent_errors_fail_at_once(web, web_shards, status, error, words):
    web.faults[:] = [status]
    web.requests.clear()
    with pytest.raises(error, match=f"shard {web_shards[2]}: {words}|shard {web_shards[2]} "
                                    f"{words}"):
        next(Files(web_shards[2], retries=5, retry_delay=0))
    assert len(web.requests) == 1  # no retry


def test_a_missing_or_truncated_http_shard_is_named_and_not_retried(web, web_shards):
    with pytest.raises(FileNotFoundError, match=f"shard {web.url('/nope.jsonl')} does not exist"):
        next(Files(web.url("/nope.jsonl"), retry_delay=0))
    whole = web.files["/b.jsonl.gz"]
    web.files["/cut.jsonl.gz"] = whole[: len(whole) // 2]
    web.requests.clear()
    with pytest.raises(OSError, match=rf"shard {web.url('/cut.jsonl.gz')}: read failed after "
                                      r"line \d+"):
        list(Files(web.url("/cut.jsonl.gz"), retry_delay=0))
    assert len(web.requests) == 1  # corrupt data is not a network fault: no retry


# -- Parquet ---------------------------------------------------------------------------------------

def test_parquet_resume_does_not_read_earlier_row_groups(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    path.write_bytes(parquet_bytes(documents(1000, size=1000), row_group_size=100))
    meta = pyarrow.parquet.ParquetFile(path).metadata
    assert meta.num_row_groups == 10

    def byte_range(group):  # where row group `group` lies in the file
        chunks = [meta.row_group(group).column(c) for c in range(meta.num_columns)]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in chunks)
        return start, start + sum(c.total_compressed_size for c in chunks)

    files = Files(str(path))
    for _ in range(700):
        next(files)
    assert files.state_dict()["slots"][0]["row_group"] == 7  # a finished group is left behind
    assert files.state_dict()["slots"][0]["row"] == 0
    for _ in range(45):
        next(files)
    state = json.loads(json.dumps(files.state_dict()))
    files.close()
    assert state["slots"][0]["row_group"] == 7 and state["slots"][0]["row"] == 45

    reads = []  # (start, end) of every read the resumed source makes
    real_open = data.smart_open.open

    def recording_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        read = f.read

        def recorded(n=-1):
            start = f.tell()
            chunk = read(n)
            reads.append((start, start + len(chunk)))
            return chunk
        f.read = recorded
        return f

    monkeypatch.setattr(data.smart_open, "open", recording_open)
    resumed = Files(str(path))
    resumed.load_state_dict(state)
    assert next(resumed)["doc"] == 745
    assert reads
    for group in range(7):
        lo, hi = byte_range(group)
        assert not [r for r in reads if r[0] < hi and r[1] > lo], f"read row group {group}"


def test_a_shards_format_comes_from_its_name_or_format_and_an_unknown_or_wrong_one_is_named(
        tmp_path):
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(jsonl_bytes(documents(3))))
    (tmp_path / "b.jsonl.bz2").write_bytes(__import__("bz2").compress(jsonl_bytes(documents(2))))
    (tmp_path / "c.data").write_bytes(jsonl_bytes(documents(4)))
    (tmp_path / "d.bin").write_bytes(parquet_bytes(documents(5), 2))
    read = list(Files([str(tmp_path / "a.json.gz"), str(tmp_path / "b.jsonl.bz2")]))
    assert read == documents(3) + documents(2)  # whole records, in order, not just a count
    with pytest.raises(ValueError, match=r"c.data: cannot tell its format.*format='jsonl'"):
        Files(str(tmp_path / "c.data"))
    assert list(Files(str(tmp_path / "c.data"), format="jsonl")) == documents(4)
    assert [r["doc"] for r in Files(str(tmp_path / "d.bin"), format="parquet")] == list(range(5))
    with pytest.raises(DataError, match=r"d.bin, line 1: bad record"):
        next(Files(str(tmp_path / "d.bin"), format="jsonl"))
    with pytest.raises(DataError, match=r"c.data: not a Parquet file"):
        next(Files(str(tmp_path / "c.data"), format="parquet"))


def test_a_format_that_overrides_a_name_is_warned_of(tmp_path, caplog):
    """--data-format text on a glob that matched .jsonl files reads their JSON as text:
    said, naming them, not done silently."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(documents(2)))
    (tmp_path / "b.data").write_bytes(b"plain words\n")
    texts = [r["text"] for r in Files(str(tmp_path / "*"), format="text")]
    assert texts[-1] == "plain words" and texts[0].startswith("{")
    assert "names say another format as text" in caplog.text and "a.jsonl" in caplog.text
    assert "b.data" not in caplog.text


@pytest.mark.slow
def test_data_format_applies_to_the_users_files_not_the_shipped_validation_set(tmp_path,
                                                                               tiny_model):
    """Parquet shards whose names don't say so, read with --data-format parquet as advised:
    the shipped validation set (JSON Lines) is still read as JSON Lines."""
    rows = [{"text": f"Document {i}: " + "the kit reads rows " * 8} for i in range(200)]
    (tmp_path / "train.bin").write_bytes(parquet_bytes(rows, 50))
    result = train(train_args(tmp_path, tiny_model, name="pq", max_steps=2, val_freq=2,
                              dataset=str(tmp_path / "train.bin"), data_format="parquet",
                              active_shards=4))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val_loss" in metrics(tmp_path / "pq")[-1]


def test_parquet_null_text_names_shard_and_row(tmp_path, caplog):
    path = tmp_path / "nulls.parquet"
    path.write_bytes(parquet_bytes([{"text": "a"}, {"text": None}, {"text": "c"}], 2))
    with pytest.raises(DataError, match=rf"shard {path}, row 2: bad record.*null field\(s\) "
                                        r"\['text'\]"):
        list(Files(str(path), required_fields=["text"]))
    files = Files(str(path), required_fields=["text"], skip_bad_records=True)
    assert [r["text"] for r in files] == ["a", "c"] and files.skipped == 1


@pytest.mark.parametrize("error, transient", [
    (ConnectionResetError(), True), (TimeoutError(), True), (FileNotFoundError(), False),
    (ValueError("bad data"), False), (EOFError(), False)])
def test_connection_errors_are_retried_and_missing_files_or_bad_data_are_not(error, transient):
    assert data.is_transient(error) is transient
    wrapped = OSError("smart_open's words")
    wrapped.__cause__ = error
    assert data.is_transient(wrapped) is transient


def test_s3_and_http_answers_that_say_try_again_are_retried_and_others_not():
    from botocore.exceptions import ClientError
    from requests.exceptions import HTTPError, SSLError

    def s3_error(code, status):
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {
            "HTTPStatusCode": status}}, "GetObject")
    assert data.is_transient(s3_error("RequestTimeout", 400))  # S3's "try again" in a 400
    assert data.is_transient(s3_error("SlowDown", 503))
    assert not data.is_transient(s3_error("NoSuchKey", 404))
    assert not data.is_transient(s3_error("AccessDenied", 403))
    response = type("Response", (), {"status_code": 429})()
    assert data.is_transient(HTTPError(response=response))
    assert not data.is_transient(SSLError("certificate verify failed"))


# -- Hugging Face datasets -------------------------------------------------------------------------

hf_sources = st.fixed_dictionaries({
    "rows": st.integers(0, 30), "shards": st.integers(1, 4), "streaming": st.booleans(),
    "repeat": st.booleans(), "epochs": st.none() | st.integers(1, 3),
    "shuffled": st.booleans(), "kit_shuffle": st.booleans(), "seed": st.integers(0, 3)})


def hf_dataset(p):
    ds = datasets.Dataset.from_list(documents(p["rows"], p["seed"])) if p["rows"] else \
        datasets.Dataset.from_dict({"text": [], "doc": []})
    if p["shuffled"]:
        ds = ds.shuffle(seed=p["seed"])  # an index mapping: still read by index
    if p["streaming"] and p["rows"]:  # (datasets cannot make an empty one this way)
        ds = ds.to_iterable_dataset(num_shards=min(p["shards"], p["rows"]))
        if p["shuffled"]:  # shard order only (buffer of 1): set_epoch reshuffles it
            ds = ds.shuffle(seed=p["seed"], buffer_size=1)
    return ds


@settings(max_examples=examples(60), deadline=None)
@given(p=hf_sources, cuts=st.lists(st.integers(0, 70), min_size=1, max_size=3))
@example(p={"rows": 0, "shards": 1, "streaming": False, "repeat": True, "epochs": 3,
            "shuffled": False, "kit_shuffle": False, "seed": 0}, cuts=[0])  # empty, 3 epochs
def test_hf_dataset_resumes_exactly(p, cuts):
    def make():
        ds = hf_dataset(p)
        shuffle = p["kit_shuffle"] and not isinstance(ds, datasets.IterableDataset)
        return HFDataset(ds, repeat=p["repeat"], epochs=p["epochs"], shuffle=shuffle,
                         seed=p["seed"])

    if p["repeat"] and p["epochs"] is None and not p["rows"]:
        with pytest.raises(DataError, match="has no rows"):
            next(make())
        return
    straight = run_with_cuts(make, [], 70)
    epochs = (p["epochs"] or 99) if p["repeat"] else 1
    assert len(straight) == min(70, p["rows"] * epochs)
    assert sorted(r["doc"] for r in straight[:p["rows"]]) == list(range(len(straight[:p["rows"]])))
    assert run_with_cuts(make, cuts, 70) == straight


def test_hf_streaming_json_files_resume(tmp_path):
    """The path train_llm takes for a Hub name: load_dataset(..., streaming=True)."""
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"part-{i}.jsonl"))
        (tmp_path / f"part-{i}.jsonl").write_bytes(jsonl_bytes(documents(20, i)))
    make = lambda: HFDataset(datasets.load_dataset(  # noqa: E731
        "json", data_files=paths, split="train", streaming=True), repeat=True, epochs=2)
    straight = run_with_cuts(make, [], 200)
    assert len(straight) == 120
    assert run_with_cuts(make, [0, 19, 20, 61, 119], 200) == straight
    state = json.loads(json.dumps(make().state_dict()))
    other = HFDataset(datasets.load_dataset("json", data_files=paths[:2], split="train",
                                            streaming=True), repeat=True, epochs=3)
    with pytest.raises(ValueError, match="epochs=2"):
        other.load_state_dict(state)


def test_hf_dataset_shuffle_is_a_new_permutation_every_epoch():
    ds = datasets.Dataset.from_list(documents(50))
    docs = [r["doc"] for r in HFDataset(ds, repeat=True, epochs=3, shuffle=True, seed=1)]
    epochs = [docs[:50], docs[50:100], docs[100:]]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert [r["doc"] for r in HFDataset(ds, shuffle=True, seed=1)] == epochs[0]
    assert [r["doc"] for r in HFDataset(ds, shuffle=True, seed=2)] != epochs[0]


def test_hf_dataset_required_fields_name_the_row():
    ds = datasets.Dataset.from_list([{"text": "a"}, {"text": None}])
    source = HFDataset(ds, required_fields=["text"])
    assert next(source)["text"] == "a"
    with pytest.raises(DataError, match=r"epoch 0, row 2: missing or null field\(s\) \['text'\]"):
        next(source)


# -- train_llm.py --dataset ------------------------------------------------------------------------

def test_the_trainers_pipeline_on_a_save_to_disk_directory_resumes_exactly(tmp_path):
    """--dataset DIR:SPLIT of a DatasetDict saved with save_to_disk: the trainer's pipeline reads
    that split by index, shuffled anew each epoch, and cut anywhere (across epochs) and resumed
    from its state, as a killed run resumes, gives the very batches of one never cut."""
    records = [json.loads(line) for path in sorted(ROOT.glob("data/sample/*/train-000.jsonl"))
               for line in path.read_text().splitlines()[:2]]
    datasets.DatasetDict({"main": datasets.Dataset.from_list(records),
                          "other": datasets.Dataset.from_list(records[:1])}).save_to_disk(
        tmp_path / "saved")
    make = trainer_pipeline([f"--dataset={tmp_path / 'saved'}:main", "--seq-length=32",
                             "--batch-size=4", "--shuffle-buffer=4"])
    pipe = make()
    source = stage(pipe, HFDataset)
    assert len(source.dataset) == len(records) and not source.streaming  # the split, on disk
    straight = run_with_cuts(make, [], 90)  # (about 30 batches an epoch: 3 epochs)
    assert len(straight) == 90
    assert run_with_cuts(make, [1, 31, 62], 90) == straight
    for _ in range(5):
        next(pipe)
    assert '"index"' in json.dumps(pipe.state_dict())  # resumed by index, not by reading
    pipe.close()


def test_a_hub_name_is_streamed(tmp_path, monkeypatch):
    """--dataset tatsu-lab/alpaca calls load_dataset(name, split, streaming=True). Offline, the
    Hub is stood in for by local files: what is checked is the wiring, not the download."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(documents(5)))
    calls = []

    def load_dataset(name, split, streaming):
        calls.append((name, split, streaming))
        return real(  # the same code path a Hub dataset of JSON files takes
            "json", data_files=str(tmp_path / "a.jsonl"), split="train", streaming=streaming)

    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for spec in ["tatsu-lab/alpaca", "someone/corpus:test"]:
        source = data.source(spec, train=True)
        assert isinstance(source, HFDataset) and source.streaming
        assert [r["doc"] for r in Count(source, 7)] == [0, 1, 2, 3, 4, 0, 1]  # repeats
    data.source("tatsu-lab/alpaca", train=False)  # --val-dataset
    assert calls == [("tatsu-lab/alpaca", "train", True), ("someone/corpus", "test", True),
                     ("tatsu-lab/alpaca", "validation", True)]
    (tmp_path / "odd:name.jsonl").write_bytes(jsonl_bytes(documents(2)))

    class Files:  # which reader source() picks, without opening (or measuring) the shards
        def __init__(self, spec, **kwargs):
            pass
    monkeypatch.setattr(data, "Files", Files)
    for spec in ["data/sample", "data/sample/*/train-*.jsonl", "s3://bucket/x-{0..1}.jsonl",
                 str(tmp_path / "a.jsonl"), str(tmp_path / "odd:name.jsonl"),
                 "data/missing-{0..1}.jsonl"]:
        assert type(data.source(spec, train=False)) is Files
    monkeypatch.undo()

    def offline(*args, **kwargs):
        raise ConnectionError("no internet here")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="'data/trian' is no local file, pattern or URL, and "
                                         "reading it as a Hugging Face dataset"):
        data.source("data/trian", train=True)
