"""Chat data (records of "messages"): trained, sampled and generated through the tokenizer's
chat template; without one, or with a record that does not end with the answer, a message that
names the shard and line; plain text given to --task sft is said to be no instruction data."""

import json

import pytest
from helpers import (
    ROOT,
    Sequence,
    jsonl,
    refused,
    script,
    toy_tokenizer,
    train,
    train_args,
    write_lines,
)
from transformers import AutoTokenizer

import data
import train_llm
import trained
from data import DataError, Files, FormatInstructions

TOY = toy_tokenizer()


CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>[{{ m['role'] }}]\n{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|endoftext|>[assistant]\n"
                 "{% endif %}")


def chat_data(tmp_path):
    return jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": f"Say the number {i} twice."},
                      {"role": "assistant", "content": f"{i} {i}."}]} for i in range(200)])


@pytest.mark.slow
def test_chat_data_trains_samples_and_generates_with_the_chat_template(
        tmp_path, tiny_model, capsys, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tok")
    chat = chat_data(tmp_path)
    result = train(train_args(tmp_path, tiny_model, name="c", task="sft", dataset=chat,
                              val_dataset=chat, tokenizer=tmp_path / "tok", max_steps=2,
                              val_freq=2, sample_prompt="Say hi."))
    assert result.returncode == 0, result.stderr
    state = json.loads((tmp_path / "c/state.json").read_text())
    assert state["config"]["prompt_format"] == "chat"
    assert trained.prompt_text(tokenizer, "Say hi.", "chat") == \
        "<|endoftext|>[user]\nSay hi.\n<|endoftext|>[assistant]\n"
    out = script("generate", [tmp_path / "c", "--prompt", "Say hi.", "--max-new-tokens", 3],
                 capsys, monkeypatch)
    assert out.startswith("<|endoftext|>[user]\nSay hi.\n<|endoftext|>[assistant]\n")
    assert "### Instruction" not in out


def test_the_prompt_layout_is_read_from_the_training_split(tmp_path):
    """A save_to_disk dataset with only a train split (the validation split is not asked for)."""
    import datasets
    records = [{"instruction": "a", "output": "b"}] * 4
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(
        tmp_path / "d")
    args = train_llm.parse_args(["-e", "x", "--task", "sft", "--dataset", str(tmp_path / "d")])
    assert data.sft_format(args.dataset, seed=args.seed) == "instruction"


@pytest.mark.slow
def test_chat_data_with_a_tokenizer_without_a_chat_template_is_refused(tmp_path, tiny_model):
    chat = chat_data(tmp_path)
    result = train(train_args(tmp_path, tiny_model, name="c", task="sft", dataset=chat,
                              val_dataset=chat, max_steps=2))
    refused(result, "no chat template", chat)


CHAT = {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]}


def test_chat_records_without_a_chat_template_stop_with_shard_and_line(tmp_path):
    url = write_lines(tmp_path / "chat.jsonl", [json.dumps({"instruction": "a", "output": "b"}),
                                                json.dumps(CHAT)])
    check = FormatInstructions(None, TOY).check
    for skip in (False, True):  # unusable data, not a bad record: never skipped
        with pytest.raises(DataError) as error:
            list(Files(url, check=check, skip_bad_records=skip))
        message = str(error.value)
        for words in (f"shard {url}, line 2: ", "chat-format ('messages')", "tokenizer toy",
                      "no chat template", "--tokenizer", "instruction/output"):
            assert words in message, (words, message)
        assert "bad record" not in message
    # A bad record stays one: skipped with skip_bad_records.
    bad = write_lines(tmp_path / "bad.jsonl", ['{"instruction": "a"}', json.dumps(
        {"instruction": "a", "output": "b"})])
    assert len(list(Files(bad, check=check, skip_bad_records=True))) == 1
    # Without Files' check, FormatInstructions itself says so, as a DataError.
    with pytest.raises(DataError, match="no chat template"):
        next(FormatInstructions(Sequence([CHAT]), TOY))


def test_chat_records_pass_with_a_chat_template(tmp_path):
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    url = write_lines(tmp_path / "chat.jsonl", [json.dumps(CHAT)])
    check = FormatInstructions(None, tokenizer).check
    out = list(FormatInstructions(Files(url, check=check), tokenizer))
    assert [s["input_ids"] for s in out] == [[3, 4, 5, 6]]
    assert [s["labels"] for s in out] == [[-100, -100, 5, 6]]


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    "{% for m in messages %}{% if m['role'] == 'assistant' %}z {% endif %}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}z {% endif %}"])
def test_a_chat_record_not_ending_with_the_answer_is_a_bad_record(tmp_path, template):
    """With or without a generation prompt in the template: never a traceback, never the
    user's last turn trained as the answer; skipped with skip_bad_records."""
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = template
    asks = {"messages": CHAT["messages"] + [{"role": "user", "content": "e f"}]}
    url = write_lines(tmp_path / "chat.jsonl", [json.dumps(CHAT), json.dumps(asks)])
    check = FormatInstructions(None, tokenizer).check
    with pytest.raises(DataError, match=f"shard {url}, line 2: bad record.*not 'assistant'"):
        list(FormatInstructions(Files(url, check=check), tokenizer))
    out = list(FormatInstructions(Files(url, check=check, skip_bad_records=True), tokenizer))
    assert [s["labels"][-3:] for s in out] == [[-100, 5, 6]]  # only the record that ends so


def test_plain_text_for_sft_is_said_to_be_no_instruction_data(tmp_path):
    url = write_lines(tmp_path / "text.jsonl", [json.dumps({"text": "a b c"})])
    with pytest.raises(DataError, match="plain text .* not instruction data.*--task pretrain"):
        list(Files(url, check=FormatInstructions.check_record))
