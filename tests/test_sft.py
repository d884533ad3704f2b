"""Supervised fine-tuning: the instruction template, prompt masking, resume, and `--task sft`."""

import json

import pytest
import torch
from helpers import (
    ROOT,
    Sequence,
    examples,
    metrics,
    run_with_cuts,
    straight_and_killed,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import data

TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
BOS = EOS = 0  # <|endoftext|>


def encode(text):
    return TOKENIZER.encode(text, add_special_tokens=False)


def format_one(record, tokenizer=TOKENIZER):
    return next(data.FormatInstructions(Sequence([record]), tokenizer))


@pytest.mark.parametrize("with_input", [False, True])
def test_alpaca_template_masks_the_prompt(with_input):
    record = {"instruction": "Name a prime.", "input": "below ten" if with_input else "",
              "output": "Seven."}
    prompt = ("Answer the instruction below.\n\n### Instruction:\nName a prime.\n\n"
              + ("### Input:\nbelow ten\n\n" if with_input else "") + "### Response:\n")
    out = format_one(record)
    prompt_ids, answer_ids = [BOS] + encode(prompt), encode("Seven.") + [EOS]
    assert out["input_ids"] == prompt_ids + answer_ids
    assert out["labels"] == [-100] * len(prompt_ids) + answer_ids
    assert TOKENIZER.decode([t for t in out["labels"] if t != -100]) == "Seven.<|endoftext|>"


def test_chat_template_masks_all_but_the_last_answer():
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[assistant]\n{% endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Two plus two?"},
                {"role": "assistant", "content": "Four"}]
    out = format_one({"messages": messages}, tokenizer)
    text = "[user]\nHi\n[assistant]\nHello\n[user]\nTwo plus two?\n[assistant]\nFour\n"
    assert out["input_ids"] == encode(text)
    answer = [t for t in out["labels"] if t != -100]
    assert TOKENIZER.decode(answer) == "Four\n"
    assert out["labels"][-len(answer):] == out["input_ids"][-len(answer):]

    with pytest.raises(ValueError, match="no chat template"):
        format_one({"messages": messages})


def test_packed_instruction_samples_keep_their_labels_and_restart_positions():
    """Two short samples in one 2 x 16 batch: labels only on the answers, positions restart."""
    records = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}]
    samples = [format_one(r) for r in records]
    length = len(samples[0]["input_ids"]) + len(samples[1]["input_ids"])
    pipe = data.Pack(data.FormatInstructions(Sequence(records), TOKENIZER), length + 2)
    (row,) = list(pipe)
    first, second = samples
    assert row["input_ids"].tolist() == first["input_ids"] + second["input_ids"] + [0, 0]
    assert row["labels"].tolist() == first["labels"] + second["labels"] + [-100, -100]
    assert row["position_ids"].tolist() == (list(range(len(first["input_ids"])))
                                            + list(range(len(second["input_ids"]))) + [0, 0])


@settings(max_examples=examples(30), deadline=None, suppress_health_check=list(HealthCheck))
@given(length=st.integers(24, 200), shuffle=st.integers(1, 8), batch=st.integers(1, 3),
       cuts=st.lists(st.integers(0, 25), min_size=1, max_size=3), seed=st.integers(0, 3))
def test_sft_pipeline_resumes_exactly(length, shuffle, batch, cuts, seed):
    """The trainer's sft chain on the shipped data, cut at random points."""
    def make():
        pipe = data.Files(str(ROOT / "data/sft/train-00[0-1].jsonl"), repeat=True,
                          shuffle_shards=True, seed=seed, n_active_shards=2,
                          required_fields=["instruction", "output"])
        pipe = data.Pack(data.FormatInstructions(pipe, TOKENIZER), length, pad_id=1)
        pipe = data.Shuffle(pipe, shuffle, seed=seed)
        return data.Prefetch(data.Batch(pipe, batch))

    straight = run_with_cuts(make, [], 25)
    assert run_with_cuts(make, cuts, 25) == straight


def test_losses_ignore_masked_targets():
    import train_llm

    logits = torch.randn(2, 5, 7)
    targets = torch.tensor([[1, 2, 3, 4, 5], [1, -100, 3, -100, -100]])
    sums, counts = train_llm.sequence_losses(logits, targets)
    assert counts.tolist() == [4, 1]
    per_token = torch.nn.functional.cross_entropy(logits[0, :-1], targets[0, 1:], reduction="none")
    torch.testing.assert_close(sums[0], per_token.sum())
    torch.testing.assert_close(sums[1], torch.nn.functional.cross_entropy(logits[1, [1]],
                                                                          targets[1, [2]]))


@pytest.mark.slow
def test_sft_demo_trains_and_resumes_exactly(tiny_model, tmp_path):
    """`--task sft` end to end on the shipped instruction data: it learns, and a run killed
    after its first checkpoint and restarted ends with the very weights of one that was not."""
    def args(name):
        return [f"--experiment-name={name}", f"--save-dir={tmp_path}",
                f"--model-name={tiny_model}", "--task=sft", "--seq-length=64", "--batch-size=4",
                "--lr=1e-2", "--warmup-steps=3", "--log-freq=5", "--val-freq=10",
                "--val-batches=2", "--ckpt-freq=10", "--max-steps=30", "--wandb=disabled"]

    _, killed, resumed = straight_and_killed(args, tmp_path)
    assert resumed == [10]

    rows = metrics(tmp_path / "straight")
    first, last = rows[0]["loss"], sum(row["loss"] for row in rows[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert [(r["step"], r["loss"]) for r in metrics(killed)] == [(r["step"], r["loss"])
                                                                 for r in rows]
    final = "checkpoints/step-000030/model.pt"
    a, b = (torch.load(d / final, weights_only=True) for d in (killed, tmp_path / "straight"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((killed / "state.json").read_text())
    assert state["config"]["task"] == "sft"
    loader = json.loads((killed / "checkpoints/step-000030/loader-rank0.json").read_text())
    assert "data/sft/train-000.jsonl" in json.dumps(loader)
