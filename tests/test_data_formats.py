"""Which format a shard is read as: its name tells it, or --data-format does; a name that tells
none is a DataError naming the flag; a directory of .txt files trains."""

import json

import pytest
from helpers import (
    train,
    train_args,
)

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
