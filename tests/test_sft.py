"""Supervised fine-tuning: the instruction template, prompt masking, and the pipeline that
`--task sft` trains on resumed exactly. (A resumed run's weights, optimizer and RNG come back
alike for every task: test_train.py kills the trainer.)"""

import pytest
import torch
from helpers import ROOT, Sequence, examples, run_with_cuts, trainer_pipeline
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
       accum=st.integers(1, 2), cuts=st.lists(st.integers(0, 25), min_size=1, max_size=3),
       seed=st.integers(0, 3))
def test_the_pipeline_of_task_sft_resumes_exactly(length, shuffle, batch, accum, cuts, seed):
    """The pipeline `--task sft` trains on (train_llm.build_pipeline: the shipped instruction
    data, formatted, packed, shuffled, batched, prefetched), cut at random points and resumed
    from its state as a run killed there resumes: the very batches of one never cut."""
    make = trainer_pipeline(["--task=sft", f"--seq-length={length}", f"--batch-size={batch}",
                             f"--grad-accum={accum}", f"--shuffle-buffer={shuffle}",
                             f"--seed={seed}", "--active-shards=2"], TOKENIZER)
    straight = run_with_cuts(make, [], 25)
    assert len(straight) == 25 and all({"labels", "position_ids"} <= set(b) for b in straight)
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
