#!/usr/bin/env python3
"""Build a small multi-domain sample corpus from text that ships with CPython.

Why: the kit must train (and be tested) fully offline, so its default data is
carved out of the Python installation itself, in four domains that differ in
how hard they are for a language model:
    code        stdlib Python source, cut at top-level def/class boundaries
    docstrings  docstrings pulled out of the stdlib with `ast` (prose about code)
    reference   the pydoc topic reference (pydoc_data.topics): language docs
    prose       plain text under Lib/: IDLE docs/NEWS, LICENSE, the Zen, CJK samples
Output: <out>/<domain>/train-000.jsonl ... train-NNN.jsonl and val-000.jsonl,
one {"text": ..., "source": ...} object per line.

Deterministic: same CPython version => same bytes. File lists are sorted, and a
SHA-256 of each text (never the salted built-in hash()) orders the documents and
picks the validation set. The committed data/sample/ came from CPython 3.11.7:
    python data/make_sample_data.py --out data/sample
"""
import argparse
import ast
import codecs
import hashlib
import html.parser
import json
import math
import re
import sys
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Tests, vendored packages and generated tables (encodings/, pydoc_data/)
# would swamp the sample with repetitive, unrepresentative text.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings",
             "pydoc_data"}
MAX_DOC_BYTES = 4096  # long texts are cut into documents of at most 4 KB ...
MIN_DOC_BYTES = 32    # ... and scraps shorter than 32 bytes are dropped


def nbytes(text):
    return len(text.encode("utf-8"))


def clean(text):
    """Normalise newlines and guarantee valid UTF-8 (a docstring may contain a
    lone surrogate from an escape like '\\udc80', which UTF-8 cannot encode)."""
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def read_text(path):
    # errors="replace": one stray non-UTF-8 byte must not abort the build.
    return path.read_bytes().decode("utf-8", errors="replace")


def pack(pieces, joiner="\n\n", finer=("\n",)):
    """Greedily glue consecutive pieces (with `joiner` between them) into
    chunks of at most MAX_DOC_BYTES. A piece too big on its own is split at the
    next finer separator first, so cuts fall at natural breaks (paragraph,
    then line) and the text inside a chunk is reproduced exactly."""
    chunks, current = [], ""
    for piece in pieces:
        sub = [piece]
        if nbytes(piece) > MAX_DOC_BYTES and finer:
            sub = pack(piece.split(finer[0]), finer[0], finer[1:])
        for s in sub:
            if current and nbytes(current + joiner + s) > MAX_DOC_BYTES:
                chunks.append(current)
                current = ""
            current = current + joiner + s if current else s
    return chunks + [current] if current else chunks


def stdlib_modules():
    """(module name, parsed ast or None, source) for stdlib .py files, sorted."""
    for path in sorted(STDLIB.rglob("*.py")):
        rel = path.relative_to(STDLIB)
        dirs = rel.parts[:-1]  # config-3.x-*/ holds build files, not library code
        if any(d in SKIP_DIRS or d.startswith("config-") for d in dirs) or \
                rel.name.startswith("_sysconfigdata"):
            continue
        source = read_text(path)
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            tree = None
        yield ".".join(rel.with_suffix("").parts).removesuffix(".__init__"), tree, source


# --------------------------------------------------------------------- domains
def code_docs():
    for name, tree, source in stdlib_modules():
        lines = source.split("\n")
        # Cut just before each top-level statement, its decorators and the
        # comment lines right above it; small neighbours are glued back by pack().
        cuts = {0}
        for node in tree.body if tree else []:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            while start > 0 and lines[start - 1].startswith("#"):
                start -= 1
            cuts.add(start)
        bounds = sorted(cuts) + [len(lines)]
        pieces = ["\n".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]
        for chunk in pack(pieces, joiner="\n", finer=("\n\n", "\n")):
            yield name, chunk


def docstring_docs():
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for name, tree, _ in stdlib_modules():
        for node in ast.walk(tree) if tree else []:  # walk order is deterministic
            doc = ast.get_docstring(node) if isinstance(node, kinds) else None
            if doc:  # get_docstring() already dedents, like inspect.cleandoc()
                where = name if isinstance(node, ast.Module) else name + "." + node.name
                for chunk in pack(doc.split("\n\n")):
                    yield where, chunk


def reference_docs():
    from pydoc_data.topics import topics
    for key in sorted(topics):
        for chunk in pack(topics[key].split("\n\n")):
            yield "pydoc_data.topics:" + key, chunk


class HTMLText(html.parser.HTMLParser):
    """Minimal HTML -> text for a Sphinx page: keep the words inside
    <div role="main"> (not the navigation), block tags become blank lines."""
    BLOCKS = {"p", "div", "pre", "li", "dt", "dd", "h1", "h2", "h3", "h4", "br", "tr"}

    def __init__(self):
        super().__init__()
        self.parts, self.depth, self.pre = [], 0, 0  # depth: <div>s deep inside "main"

    def handle_starttag(self, tag, attrs):
        self.depth += tag == "div" and (self.depth > 0 or ("role", "main") in attrs)
        self.pre += tag == "pre"
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        self.depth -= tag == "div" and self.depth > 0
        self.pre -= tag == "pre"

    def handle_data(self, data):
        if not self.depth:
            return
        if not self.pre:  # outside <pre>, a run of whitespace is just one space
            data = re.sub(r"\s+", " ", data)
            data = data.lstrip() if self.parts[-1].endswith("\n") else data
        self.parts.append(data.replace("\u00b6", ""))  # drop Sphinx's pilcrow links


def prose_texts():
    """(source, text) pairs of plain prose. Missing files are simply skipped:
    some distributions ship idlelib/ or test/ as separate packages."""
    globs = ["LICENSE.txt", "email/*.rst", "idlelib/*.txt", "idlelib/ChangeLog",
             "distutils/README", "ctypes/macholib/README.ctypes",
             "test/cjkencodings/*-utf8.txt"]  # short Chinese/Japanese/Korean texts
    for pattern in globs:
        for path in sorted(STDLIB.glob(pattern)):
            yield str(path.relative_to(STDLIB)), read_text(path)
    if (STDLIB / "idlelib/help.html").exists():
        parser = HTMLText()
        parser.feed(read_text(STDLIB / "idlelib/help.html"))
        yield "idlelib/help.html", "".join(parser.parts)
    # The Zen of Python lives rot13-encoded in this.py; importing `this` would
    # print it, so read the string literal `s` with ast instead.
    zen = next(node.value.value for node in ast.parse(read_text(STDLIB / "this.py")).body
               if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "s")
    yield "this", codecs.decode(zen, "rot13")


def prose_docs():
    for source, text in prose_texts():
        for chunk in pack([p for p in clean(text).split("\n\n") if p.strip()]):
            yield source, chunk


DOMAINS = {"code": code_docs, "docstrings": docstring_docs,
           "reference": reference_docs, "prose": prose_docs}


# --------------------------------------------------------------------- writing
def select(docs, max_bytes):
    """Clean and dedupe, order by content hash (a deterministic shuffle that
    mixes modules/topics), then keep documents until the byte budget is full."""
    unique = {}
    for source, text in docs:
        text = clean(text)
        key = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if nbytes(text) >= MIN_DOC_BYTES and key not in unique:
            unique[key] = (key, source, text)
    kept, total = [], 0
    for key in sorted(unique):
        if total + nbytes(unique[key][2]) <= max_bytes:  # a later, smaller doc may still fit
            kept.append(unique[key])
            total += nbytes(unique[key][2])
    return kept


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for _, source, text in docs:
            f.write(json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n")


def build_domain(name, out_dir, args):
    docs = select(DOMAINS[name](), args.max_bytes_per_domain)
    # The hash also picks the validation docs: about 1 in --val-every.
    val = [d for d in docs if int(d[0][:8], 16) % args.val_every == 0] or docs[:1]
    val_keys = {d[0] for d in val}
    train = [d for d in docs if d[0] not in val_keys]
    train_bytes = sum(nbytes(d[2]) for d in train)
    n_shards = max(args.min_shards, math.ceil(train_bytes / args.shard_bytes))
    shards, seen = [[] for _ in range(n_shards)], 0
    for doc in train:  # consecutive runs of docs, roughly equal bytes per shard
        shards[min(n_shards - 1, seen * n_shards // max(train_bytes, 1))].append(doc)
        seen += nbytes(doc[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in sorted(out_dir.glob("*.jsonl")):  # an older run may have had more shards
        stale.unlink()
    for i, shard in enumerate(shards):
        write_jsonl(out_dir / f"train-{i:03d}.jsonl", shard)
    write_jsonl(out_dir / "val-000.jsonl", val)
    return len(train), len(val), train_bytes + sum(nbytes(d[2]) for d in val), n_shards


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/sample"))
    ap.add_argument("--max-bytes-per-domain", type=int, default=1_500_000)
    ap.add_argument("--shard-bytes", type=int, default=200_000, help="target train shard size")
    ap.add_argument("--min-shards", type=int, default=4, help="at least this many train shards")
    ap.add_argument("--val-every", type=int, default=20, help="~1 in N docs go to val (5%%)")
    args = ap.parse_args()
    print(f"CPython {sys.version.split()[0]}, stdlib at {STDLIB}")
    print(f"{'domain':<12}{'train docs':>11}{'val docs':>9}{'bytes':>11}{'shards':>8}")
    for name in DOMAINS:
        n_train, n_val, size, n_shards = build_domain(name, args.out / name, args)
        print(f"{name:<12}{n_train:>11}{n_val:>9}{size:>11,}{n_shards:>8}")


if __name__ == "__main__":
    main()
