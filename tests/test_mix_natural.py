"""--mix natural: each domain weighed by the bytes of its files, measured when the run starts
and kept in the run, so that a killed run resumes to the very same bits."""

import gzip
import json

import pytest
import torch
from helpers import metrics, straight_and_killed, train_args

import data
import utils


def domains(root, sizes):
    """One directory per domain, its shards holding about ``sizes[name]`` bytes of text."""
    for name, size in sizes.items():
        (root / name).mkdir(parents=True)
        line = json.dumps({"text": f"{name} " + "word " * 20}) + "\n"
        for k in range(2):
            (root / name / f"train-{k}.jsonl").write_text(line * (size // len(line) // 2))
    return f"{root}/*/train-*.jsonl"


def test_natural_weights_follow_the_domains_sizes(tmp_path):
    pattern = domains(tmp_path, {"big": 60_000, "small": 20_000, "tiny": 4_000})
    sizes = data.natural_sizes(pattern)
    files = {name: sum(p.stat().st_size for p in (tmp_path / name).glob("train-*.jsonl"))
             for name in ("big", "small", "tiny")}
    assert sizes == files
    weights = utils.domain_weights(list(sizes), sizes)
    assert weights == pytest.approx([files[n] / sum(files.values()) for n in sizes])


@pytest.mark.slow
def test_a_natural_mix_killed_resumes_exactly_with_the_weights_it_started_with(tiny_model,
                                                                                tmp_path):
    pattern = domains(tmp_path / "data", {"big": 60_000, "small": 20_000})

    def args(name):
        return train_args(tmp_path, tiny_model, name=name, dataset=pattern, val_dataset=pattern,
                          mix="natural", ckpt_freq=5, max_steps=15, val_freq=5)

    assert straight_and_killed(args, tmp_path, at=7)[2] == [5]
    final = "checkpoints/step-000015/model.pt"
    a, b = (torch.load(tmp_path / d / final, weights_only=True) for d in ("killed", "straight"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ("step", "loss", "val_loss", "mix/p_big", "mix/p_small", "mix/tokens_big")
    assert ([[row.get(k) for k in keys] for row in metrics(tmp_path / "killed")]
            == [[row.get(k) for k in keys] for row in metrics(tmp_path / "straight")])
    state = json.loads((tmp_path / "straight/state.json").read_text())
    big, small = (state["config"]["mix_weights"][n] for n in ("big", "small"))
    assert big == pytest.approx(0.75, abs=0.01) and small == pytest.approx(0.25, abs=0.01)
    assert metrics(tmp_path / "straight")[0]["mix/p_big"] == big


def test_natural_weights_of_a_compressed_domain_beside_plain_ones_are_warned_about(tmp_path,
                                                                                   caplog):
    """Bytes as stored: a gzipped domain weighs less than its text. Said, naming it; a run of
    only plain (or only compressed) domains says nothing."""
    pattern = domains(tmp_path, {"code": 40_000, "prose": 40_000})
    data.natural_sizes(pattern)
    assert "compressed" not in caplog.text
    for shard in (tmp_path / "code").glob("*.jsonl"):
        shard.with_suffix(".jsonl.gz").write_bytes(gzip.compress(shard.read_bytes()))
        shard.unlink()
    sizes = data.natural_sizes(str(tmp_path / "*/train-*.jsonl*"))
    assert sizes["code"] < sizes["prose"] / 3
    assert "the shards of code are compressed, others not" in caplog.text
