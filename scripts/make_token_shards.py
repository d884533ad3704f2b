"""Write text shards (what --dataset takes) as pre-tokenized token files, the way nanoGPT and
llm.c store their data, so that the same documents train from either:

    python scripts/make_token_shards.py --data 'data/sample/*/train-*.jsonl' --out shards \
        --layout llmc
    python train_llm.py -e tokens --dataset 'shards/*/train-*.bin'

One token file per input shard, at the same place under --out (a domain's directory stays a
domain for --mix). The layouts (DESIGN.md section 10):

    nanogpt  raw uint16 token ids (a vocabulary of at most 65,536), EOS after each document,
             as nanoGPT's prepare.py writes train.bin
    llmc     a header of 256 int32 (magic 20240520, version 1, the token count; uint32 ids:
             20240801, version 7), then the ids, EOS before each document, as llm.c's dev/data
    npy      a numpy .npy array of the ids, EOS after each document

The ids are the tokenizer's for each record's --column, without special tokens: documents are
told apart by EOS alone, and the kit adds BOS and EOS when it reads them (data.EnsureBosEos).

All or none: each file is written as a hidden .NAME.tmp and renamed once whole, and a failure (a
full disk, a bad record, Ctrl-C) removes what the command wrote, so the same command reruns.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import utils  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def token_ids(url, tokenizer, column, eos, eos_first, dtype):
    """The ids of every document of one shard, EOS before (llm.c) or after each one."""
    parts, texts = [], []

    def encode():  # 256 documents at a time
        for doc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            parts.append(np.array([eos, *doc] if eos_first else [*doc, eos], dtype=dtype))
        texts.clear()

    for record in data.Files(url, n_active_shards=1, required_fields=[column]):
        texts.append(record[column])
        if len(texts) == 256:
            encode()
    encode()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def write(path, ids, layout):
    """One token file of ``ids`` in ``layout``, written as .NAME.tmp beside it (a name no shard
    has: hidden, and no token file's suffix) and renamed once whole: a kill leaves no file the
    kit takes as a shard, a failed write (a full disk) not even that, and names ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")  # (this script's own name: one a kill left, replaced)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            if layout == "npy":
                np.save(f, ids)
            else:
                if layout == "llmc":
                    header = np.zeros(256, dtype=np.int32)
                    magic, version = next(key for key, dtype in data.LLMC_HEADERS.items()
                                          if dtype == ids.dtype)
                    header[:3] = [magic, version, len(ids)]
                    f.write(header.tobytes())
                f.write(ids.tobytes())
            f.flush()
            os.fsync(f.fileno())  # (on disk before its name says it is whole)
        if path.exists():  # (made since main's check: perhaps not this script's, so kept)
            raise FileExistsError(f"{path} appeared while this script wrote it: kept, and "
                                  "nothing written; move it away, or pick another --out")
        os.rename(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        failure = isinstance(e, OSError) and not isinstance(e, FileExistsError) and \
            utils.write_failure(path, e)
        if failure:
            raise failure from e
        raise


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the text shards (files, globs, a directory)")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument("--layout", choices=("nanogpt", "llmc", "npy"), default="llmc")
    parser.add_argument("--tokenizer", default=str(ROOT / "assets/tokenizer"))
    parser.add_argument("--column", default="text", help="the field that holds the text")
    args = parser.parse_args()
    tokenizer = utils.pretrained(AutoTokenizer, args.tokenizer, "--tokenizer")
    if tokenizer.eos_token_id is None:
        sys.exit(f"--tokenizer {args.tokenizer} has no EOS token: token files tell documents "
                 "apart by EOS")
    if args.out.exists() and not args.out.is_dir():
        sys.exit(f"--out {args.out} is a file: give the directory to write the token files in")
    urls = data.expand_urls(args.data)
    if any("://" in url for url in urls):
        sys.exit("--data: local files only (copy remote shards first)")
    if tokens := [url for url in urls if data.shard_format(url) == "tokens"]:
        sys.exit(f"--data {tokens[0]} is a token file already: this script makes token files "
                 "from text shards (JSON Lines, JSON arrays, text, Parquet)")
    common = os.path.commonpath([os.path.dirname(os.path.abspath(url)) for url in urls])
    suffix = ".npy" if args.layout == "npy" else ".bin"
    dtype = np.uint32 if len(tokenizer) > 1 << 16 else np.uint16
    if dtype == np.uint32 and args.layout == "nanogpt":
        sys.exit(f"--layout nanogpt stores uint16 ids, and {args.tokenizer} has "
                 f"{len(tokenizer):,}: pass --layout llmc or npy")
    outs = {}
    for url in urls:  # every output's name first: two shards never write one file
        relative = Path(os.path.relpath(os.path.abspath(url), common))
        name = relative.name
        for ending in (*data._COMPRESSED, ".jsonl", ".json", ".ndjson", ".parquet", ".txt"):
            name = name.removesuffix(ending)  # (train-00000.jsonl.gz: train-00000)
        out = args.out / relative.parent / (name + suffix)
        if out in outs.values():
            sys.exit(f"{url} and another shard would both be written as {out}: nothing written")
        outs[url] = out
    there = [out for out in outs.values() if out.exists()]
    if there:  # (perhaps not this script's: never written over)
        sys.exit(f"{there[0]} exists ({len(there)} of the {len(outs)} files to write do): nothing "
                 "written; move them away, or pick another --out")
    written = []  # all or none: a failure removes what this command wrote, so it can rerun
    try:
        for url, out in outs.items():
            ids = token_ids(url, tokenizer, args.column, tokenizer.eos_token_id,
                            eos_first=args.layout == "llmc", dtype=dtype)
            write(out, ids, args.layout)
            written.append(out)
            print(f"{url}: {len(ids):,} tokens -> {out}")
    except BaseException as e:
        for out in written:
            out.unlink(missing_ok=True)
        if not isinstance(e, (OSError, data.DataError, KeyboardInterrupt)):
            raise
        sys.exit(("Stopped (Ctrl-C)." if isinstance(e, KeyboardInterrupt) else
                  f"{type(e).__name__}: {str(e).rstrip('.')}.") + " Nothing is kept" + (
                  f" (the {len(written)} token file(s) it wrote are removed)" if written else "")
                 + ": the same command starts over.")


if __name__ == "__main__":
    try:
        main()
    except (OSError, data.DataError) as e:
        sys.exit(f"{type(e).__name__}: {e}")
