"""What resuming costs for each kind of source: bytes fetched and time to the first record.

    python benchmarks/bench_sources.py [--shard-mb 64] [--quick]     # ~1 min on 2 cores

One shard of generated documents (default 64 MB of JSONL) is served by a real S3 API server on
127.0.0.1 (moto) as .jsonl, .jsonl.zst and .parquet, and kept on local disk as a
`save_to_disk` dataset and as JSONL for `load_dataset(..., streaming=True)`. For each, one
pass takes loader states after 1%, 50% and 99% of the records; then a new source loads each
state and reads one record. S3 bytes are counted as the client reads them from the response
bodies; local bytes are this process's read() calls (/proc/self/io, page cache warm). A fresh
start (no state) is measured the same way, for the ratio.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

import boto3  # noqa: E402
import datasets  # noqa: E402
import pyarrow  # noqa: E402
import pyarrow.parquet  # noqa: E402
import zstandard  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

import data  # noqa: E402

datasets.disable_progress_bars()


def documents(target_bytes, seed=0):
    """Random 'words' documents of 200-2000 bytes, each with its index, up to target_bytes."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("etaoinshrdlucm", k=rng.randint(1, 9))) for _ in range(5000)]
    docs, size = [], 0
    while size < target_bytes:
        text = " ".join(rng.choices(words, k=rng.randrange(40, 400)))
        docs.append({"id": len(docs), "text": text})
        size += len(text) + 30
    return docs


def s3_client():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    client.create_bucket(Bucket="bench")
    client.fetched = [0]

    def count(parsed, **_):  # wrap every GetObject body: count the bytes read from it
        if "Body" in parsed:
            read = parsed["Body"].read

            def counted(*args, **kwargs):
                chunk = read(*args, **kwargs)
                client.fetched[0] += len(chunk)
                return chunk
            parsed["Body"].read = counted

    client.meta.events.register("after-call.s3.GetObject", count)
    return server, client


def rchar():
    with open("/proc/self/io", "rb", buffering=0) as f:
        return int(f.read().split(b"rchar:")[1].split()[0])


def first_record(make, state, fetched):
    """(seconds, bytes) to [load state and] get the first record of a new source."""
    source = make()
    b0, t0 = fetched(), time.perf_counter()
    if state is not None:
        source.load_state_dict(state)
    record = next(source)
    seconds, nbytes = time.perf_counter() - t0, fetched() - b0
    source.close()
    return seconds, nbytes, record["id"]


def measure(name, make, fetched, n_docs, repeats):
    source, states, done = make(), {}, 0
    t0 = time.perf_counter()
    for pct in (1, 50, 99):
        n = n_docs * pct // 100
        for _ in range(n - done):
            next(source)
        done, states[pct] = n, json.loads(json.dumps(source.state_dict()))
    source.close()
    print(f"  {name}: states in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    fresh = [first_record(make, None, fetched) for _ in range(repeats)]
    rows = []
    for pct, state in states.items():
        runs = [first_record(make, state, fetched) for _ in range(repeats)]
        assert all(r[2] == n_docs * pct // 100 for r in runs), f"{name}: wrong record"
        rows.append((pct, statistics.median(r[1] for r in runs),
                     statistics.median(r[0] for r in runs)))
    return rows, statistics.median(r[1] for r in fresh), statistics.median(r[0] for r in fresh)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shard-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="medians of this many")
    parser.add_argument("--quick", action="store_true", help="8 MB, 1 repeat: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.shard_mb, args.repeats = 8, 1
    docs = documents(args.shard_mb * 1e6)
    jsonl = "".join(json.dumps(d) + "\n" for d in docs).encode()
    sink = pyarrow.BufferOutputStream()
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(docs), sink,
                                row_group_size=len(docs) // 16 + 1)  # 16 row groups
    bodies = {"jsonl": jsonl, "jsonl.zst": zstandard.ZstdCompressor().compress(jsonl),
              "parquet": sink.getvalue().to_pybytes()}
    server, client = s3_client()
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for ext, body in bodies.items():
                client.put_object(Bucket="bench", Key=f"shard.{ext}", Body=body)
                url = f"s3://bench/shard.{ext}"
                results.append((f"`Files` over S3, .{ext}", len(body), measure(
                    ext, lambda u=url: data.Files(u, transport_params={"client": client}),
                    lambda: client.fetched[0], len(docs), args.repeats)))
            local = os.path.join(tmp, "shard.jsonl")
            Path(local).write_bytes(jsonl)
            datasets.Dataset.from_list(docs).save_to_disk(os.path.join(tmp, "saved"))
            saved = datasets.load_from_disk(os.path.join(tmp, "saved"))
            results.append(("`HFDataset`, `load_from_disk` (map-style)", len(jsonl), measure(
                "saved", lambda: data.HFDataset(saved), rchar, len(docs), args.repeats)))
            results.append(("`HFDataset`, `load_dataset(json, streaming=True)`", len(jsonl),
                            measure("streaming", lambda: data.HFDataset(datasets.load_dataset(
                                "json", data_files=local, split="train", streaming=True)),
                                rchar, len(docs), args.repeats)))
    finally:
        server.stop()
    print(f"\n{len(docs):,} documents, {len(jsonl) / 1e6:.0f} MB of JSONL; medians of "
          f"{args.repeats}.\n")
    print("| source | shard | fetched to resume at 1% / 50% / 99% | ÷ shard at 99% | "
          "time to 1st record at 1% / 50% / 99% | fresh start |")
    print("|---|---:|---|---:|---|---|")
    for name, size, (rows, fresh_bytes, fresh_s) in results:
        fetched = " / ".join(f"{b / 1e6:.2f} MB" for _, b, _ in rows)
        times = " / ".join(f"{s * 1e3:.0f} ms" for _, _, s in rows)
        print(f"| {name} | {size / 1e6:.0f} MB | {fetched} | {rows[-1][1] / size:.3f} | "
              f"{times} | {fresh_s * 1e3:.0f} ms, {fresh_bytes / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
