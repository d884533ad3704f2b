"""Which format a shard is read as: its name tells it, or --data-format does; a name that tells
none is a DataError naming the flag; a directory of .txt files trains."""

import codecs
import json
import os
import tempfile
from pathlib import Path

import pytest
from helpers import (
    examples,
    train,
    train_args,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from data import DataError, Files


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


@pytest.mark.slow
def test_a_shard_named_otherwise_trains_with_data_format(tmp_path, tiny_model):
    """(Without the flag, a DataError names it: test_data_faults.py.)"""
    orig = tmp_path / "one.jsonl.orig"
    orig.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n"
                            for i in range(50)))
    result = train(train_args(tmp_path, tiny_model, name="o", dataset=orig, max_steps=1,
                              data_format="jsonl"))
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_txt_dataset_trains(tmp_path, tiny_model):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"part-{i}.txt").write_text("".join(f"line {j} of part {i} in plain text.\n"
                                                     for j in range(200)))
    result = train(train_args(tmp_path, tiny_model, dataset=str(texts), val_dataset=str(texts),
                              max_steps=3))
    assert result.returncode == 0, result.stderr
    assert "in both --dataset and --val-dataset" in result.stderr  # the overlap is flagged


# Any text, lone surrogates included (json.dumps escapes them, or they go out "surrogatepass").
TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=8)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
LINE = st.one_of(
    st.builds(lambda value, ascii, pad: (pad + json.dumps(value, ensure_ascii=ascii) + pad)
              .encode("utf-8", "surrogatepass"), JSON, st.booleans(), st.sampled_from(["", " \t"])),
    st.builds(lambda record: json.dumps(record).encode(), st.dictionaries(TEXT, JSON, max_size=3)),
    st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")))  # bad lines, and blank ones


@settings(max_examples=examples(300), deadline=None)
@given(lines=st.lists(LINE, min_size=1, max_size=6), bom=st.booleans())
@example(lines=[b"{}", '{"t": "\ud800 é"}'.encode("utf-8", "surrogatepass"), b"[1]", b" "],
         bom=True)
def test_a_json_lines_record_is_what_json_loads_makes_of_its_line(lines, bom):
    """Files parses a line as json.loads parses those bytes (a BOM, escapes, lone surrogates);
    a line json.loads refuses, or that holds no object, is a bad record; blank lines are none."""
    if bom:  # (a new list: hypothesis reports the example it drew)
        lines = [codecs.BOM_UTF8 + lines[0], *lines[1:]]
    expected = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            value = None if line.isspace() or not line else "bad"
        else:
            value = value if isinstance(value, dict) else "bad"
        if value is not None:
            expected.append(value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        files = Files(str(path), skip_bad_records=True)
        # (compared as JSON text: a NaN in a record is not equal to itself)
        assert [json.dumps(r) for r in files] == [json.dumps(v) for v in expected if v != "bad"]
        assert files.skipped == expected.count("bad")


def test_a_text_shard_that_starts_with_a_bom_reads_its_text_without_it(tmp_path):
    """A .txt file saved with a BOM (Notepad, Excel): the first record is the text, as a
    .jsonl shard's is; the BOM is not trained as a character."""
    path = tmp_path / "notes.txt"
    path.write_bytes(codecs.BOM_UTF8 + b"first line\nsecond line\r\n")
    assert [r["text"] for r in Files(str(path))] == ["first line", "second line"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_shard_that_is_no_regular_file_is_refused_by_name_before_it_is_read(tmp_path, kind):
    """A FIFO with no writer would block the start forever, /dev/zero fill the memory with one
    endless line: both are refused, naming the path, before anything opens them."""
    path = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(DataError, match=f"shard {path}: not a regular file"):
        Files(str(path))
