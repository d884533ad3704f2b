"""Mixing domains: data.Mix with fixed weights, --mix natural (each domain weighed by the bytes
of its files, measured when the run starts and kept in the run), and the Online Data Mixing
bandit."""

import gzip
import json
import math
import subprocess
import sys

import pytest
from helpers import (
    ROOT,
    Sequence,
    digest,
    examples,
    metrics,
    straight_and_killed,
    train,
    train_args,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import data
import utils
from data import Batch, Mix, OnlineMixer, Prefetch


def test_exp3_rewards_and_probabilities_equal_hand_computed_values():
    mixer = OnlineMixer([1, 1], variant="exp3", alpha=0.9)
    # Step 1: both domains in the batch, p = (0.5, 0.5).
    # R = 0.1 * L / p = (0.1 * 2.0 / 0.5, 0.1 * 1.0 / 0.5) = (0.4, 0.2).
    # eps_1 = min(1/2, sqrt(ln 2 / 2)) = 0.5, so 1 - K eps = 0: p = (0.5, 0.5).
    mixer.update({0: 2.0, 1: 1.0}, step=1)
    assert mixer.rewards == pytest.approx([0.4, 0.2])
    assert mixer.probabilities == pytest.approx([0.5, 0.5])
    # Step 2: only domain 0. R0 = 0.9 * 0.4 + 0.1 * 2.0 / 0.5 = 0.76, R1 stays 0.2.
    # softmax(eps_1 R) = softmax(0.38, 0.10); eps_2 = sqrt(ln 2 / 4) = 0.41628.
    mixer.update({0: 2.0}, step=2)
    eps2 = math.sqrt(math.log(2) / 4)
    share0 = math.exp(0.38) / (math.exp(0.38) + math.exp(0.10))
    assert mixer.rewards == pytest.approx([0.76, 0.2])
    assert mixer.probabilities == pytest.approx([(1 - 2 * eps2) * share0 + eps2,
                                                 (1 - 2 * eps2) * (1 - share0) + eps2])
    assert mixer.probabilities[0] == pytest.approx(0.5116, abs=1e-4)  # by hand


def test_smoothed_mean_rewards_and_probabilities_equal_hand_computed_values():
    mixer = OnlineMixer([1, 1, 2], variant="smoothed-mean", alpha=0.5, warmup_steps=1)
    mixer.update({0: 1.0, 1: 2.0, 2: 3.0}, step=1)  # inside warm-up: nothing changes
    assert mixer.probabilities == [0.25, 0.25, 0.5] and mixer.rewards == [0, 0, 0]
    # Step 100: R = 0.5 * exp(L); eps = min(1/3, sqrt(ln 3 / 300)) = 0.060514.
    mixer.update({0: 1.0, 1: 2.0, 2: 0.0}, step=100)
    rewards = [0.5 * math.e, 0.5 * math.e ** 2, 0.5]
    eps = math.sqrt(math.log(3) / 300)
    assert mixer.rewards == pytest.approx(rewards)
    assert mixer.probabilities == pytest.approx(
        [(1 - 3 * eps) * r / sum(rewards) + eps for r in rewards])
    assert sum(mixer.probabilities) == pytest.approx(1)


@pytest.mark.parametrize("variant, at_least", [("exp3", 0.36), ("smoothed-mean", 0.8)])
def test_the_mixer_moves_toward_the_domain_that_stays_hard(variant, at_least):
    """Domain 2's loss stays at 4 while the others fall to 1: its probability must grow
    above its initial third and above every other domain's. (exp3 moves slowly: its softmax
    temperature is eps_t, 0.027 at step 500; smoothed-mean weighs exp(loss) directly.)"""
    mixer = OnlineMixer([1, 1, 1], variant=variant, alpha=0.9, warmup_steps=10)
    for step in range(1, 501):
        easy = max(1.0, 4.0 - step / 50)
        mixer.update({0: easy, 1: easy, 2: 4.0}, step)
    p = mixer.probabilities
    assert p[2] > at_least and p[2] > max(p[0], p[1]), p


def test_fixed_weights_draw_domains_in_proportion():
    weights = [0.5, 0.3, 0.2]
    mix = Mix({name: Sequence([{"x": name}], repeat=True) for name in "abc"}, weights, seed=3)
    n = 20_000
    counts = [0, 0, 0]
    for _ in range(n):
        counts[next(mix)["domain"]] += 1
    for count, w in zip(counts, weights):
        sigma = math.sqrt(n * w * (1 - w))
        assert abs(count - n * w) < 4 * sigma, (counts, weights)  # fails by chance ~1e-4


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


def make_mix(weights, variant, warmup, seed, prefetch):
    domains = {}
    for d, name in enumerate(["code", "web", "books"][:len(weights)]):
        pipe = Sequence([{"id": f"{name}-{i}"} for i in range(5 + d)], repeat=True, shuffle=True,
                        seed=seed)
        domains[name] = Prefetch(pipe) if prefetch else pipe
    mixer = None if variant == "fixed" else OnlineMixer(weights, variant=variant,
                                                         warmup_steps=warmup)
    return Mix(domains, weights, seed=seed, mixer=mixer)


def train_like(make, cuts, steps, batch=4):
    """Drive a Mix as the trainer would: a batch per step, then per-domain losses (made up,
    but a function of what was drawn) fed to the mixer. Cut at the given steps: state through
    JSON, a new Mix, load, go on. Returns the samples and the probabilities of every step."""
    mix, out = make(), []
    for step in range(1, steps + 1):
        if step in cuts:
            state = json.loads(json.dumps(mix.state_dict()))
            mix.close()
            mix = make()
            mix.load_state_dict(state)
        samples = [next(mix) for _ in range(batch)]
        losses = {}
        for s in samples:
            losses.setdefault(s["domain"], []).append(1 + len(s["id"]) % 3 + s["domain"])
        if mix.mixer:
            mix.mixer.update({d: sum(v) / len(v) for d, v in losses.items()}, step)
        out.append(([s["id"] for s in samples], list(mix.probabilities)))
    mix.close()
    return out


@settings(max_examples=examples(60), deadline=None)
@given(weights=st.lists(st.integers(1, 5), min_size=2, max_size=3),
       variant=st.sampled_from(["fixed", "exp3", "smoothed-mean"]), warmup=st.integers(0, 8),
       seed=st.integers(0, 3), prefetch=st.booleans(),
       cuts=st.sets(st.integers(1, 20), min_size=1, max_size=3))
def test_mix_resumes_exactly_inside_and_after_warmup(weights, variant, warmup, seed, prefetch,
                                                     cuts):
    def make():
        return make_mix(weights, variant, warmup, seed, prefetch)

    assert train_like(make, cuts, 20) == train_like(make, set(), 20)


@settings(max_examples=examples(20), deadline=None)
@given(weights=st.lists(st.integers(1, 5), min_size=2, max_size=3),
       variant=st.sampled_from(["exp3", "smoothed-mean"]), warmup=st.integers(0, 4),
       seed=st.integers(0, 3), every=st.integers(1, 3),
       cuts=st.sets(st.integers(2, 12), max_size=2))
def test_a_prefetch_that_follows_the_mixer_draws_and_resumes_as_the_mix_here(
        weights, variant, warmup, seed, every, cuts):
    """ODM learns in the trainer's process and Mix draws in Prefetch's: at each step's start
    (every ``every`` batches) the child takes the mixer's state, so every batch, and a resume
    at any step, is what a Mix in this process gives."""
    def make(ahead):
        mix = make_mix(weights, variant, warmup, seed, prefetch=False)
        pipe = Batch(mix, 3)
        return (Prefetch(pipe, 2, follow=mix.mixer, every=every) if ahead else pipe), mix.mixer

    def steps(ahead, cuts):
        (pipe, mixer), out = make(ahead), []
        for step in range(1, 13):
            if step in cuts:
                state = json.loads(json.dumps(pipe.state_dict()))
                pipe.close()
                (pipe, mixer) = make(ahead)
                pipe.load_state_dict(state)
            batches = [next(pipe) for _ in range(every)]
            ids = [i for batch in batches for i in batch["id"]]
            domains = [d for batch in batches for d in batch["domain"].tolist()]
            mixer.update({d: 1 + domains.count(d) % 3 for d in set(domains)}, step)
            out.append((ids, list(mixer.probabilities)))
        pipe.close()
        return out

    assert steps(True, cuts) == steps(False, set())


def design_curriculum():
    """The Curriculum class of DESIGN.md section 9, as the text there has it."""
    text = (ROOT / "DESIGN.md").read_text()
    code = text[text.index("```python\nclass Curriculum"):].split("```")[1].removeprefix("python")
    namespace = {}
    exec(code, namespace)
    return namespace["Curriculum"]


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 3), prefetch=st.booleans(),
       cuts=st.sets(st.integers(1, 20), min_size=1, max_size=3))
def test_a_curriculum_mixer_as_design_shows_it_resumes_exactly(seed, prefetch, cuts):
    """A mixer of one's own (the interface of OnlineMixer): probabilities move with the step
    from the start weights to the end ones, and a Mix cut anywhere draws the very same."""
    curriculum = design_curriculum()

    def make():
        mix = make_mix([1, 1, 4], "fixed", 0, seed, prefetch)
        mix.mixer = curriculum([1, 1, 4], [4, 1, 1], steps=12)
        return mix

    straight = train_like(make, set(), 20)
    assert straight[0][1] != straight[12][1] == straight[19][1] == [4, 1, 1]
    assert train_like(make, cuts, 20) == straight


def test_a_mix_state_from_other_domains_is_refused():
    state = make_mix([1, 1], "exp3", 0, 0, False).state_dict()
    with pytest.raises(ValueError, match="domains"):
        make_mix([1, 1, 1], "exp3", 0, 0, False).load_state_dict(state)


@pytest.mark.slow
def test_trainer_with_natural_weights_and_odm_killed_in_and_after_warmup_resumes_exactly(
        tiny_model, tmp_path):
    """`--mix natural --odm exp3` on the four sample domains: the bandit starts from each
    domain's share of the bytes, measured when the run starts and kept in its state. SIGKILL
    once inside the warm-up and once after it; the restarted run ends with the very weights,
    loader state and probability trajectory of an uninterrupted one, and the probabilities
    did move from the natural weights."""
    import torch

    def args(name):
        return train_args(tmp_path, tiny_model, name=name, mix="natural", odm="exp3",
                          odm_warmup_steps=12, ckpt_freq=5, max_steps=30)

    # Resumed from a checkpoint inside the warm-up, then from one after it.
    straight, killed, resumed = straight_and_killed(args, tmp_path, at=(8, 17))
    assert resumed == [5, 15]
    final = "checkpoints/step-000030"
    a, b = (torch.load(d / final / "model.pt", weights_only=True) for d in (killed, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert digest(killed / final / "loader-rank0.json") == digest(straight / final /
                                                                 "loader-rank0.json")
    keys = [k for k in metrics(straight)[-1] if k.startswith(("mix/", "val_loss"))] + ["loss"]
    assert len([k for k in keys if k.startswith("mix/p_")]) == 4
    assert ([[row.get(k) for k in keys] for row in metrics(killed)]
            == [[row.get(k) for k in keys] for row in metrics(straight)])
    # The natural weights: each domain's bytes over all, recorded, and the warm-up's mixture.
    names = ("code", "docstrings", "prose", "reference")
    sizes = {d: sum(p.stat().st_size for p in (ROOT / "data/sample" / d).glob("train-*.jsonl"))
             for d in names}
    natural = json.loads((straight / "state.json").read_text())["config"]["mix_weights"]
    assert natural == pytest.approx({d: sizes[d] / sum(sizes.values()) for d in names})
    assert max(natural.values()) > min(natural.values()) + 0.05  # (not the uniform start)
    first, last = metrics(straight)[0], metrics(straight)[-1]
    assert all(first[f"mix/p_{d}"] == pytest.approx(natural[d], rel=1e-12) for d in names)
    assert any(abs(last[f"mix/p_{d}"] - natural[d]) > 1e-3 for d in names)
    result = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(straight)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_mixed_run_on_the_shipped_data_with_the_default_validation_warns_of_nothing(
        tmp_path, tiny_model):
    """The default --val-batches takes what each domain's validation shards hold, quietly;
    the same number given by hand still warns that the set is smaller."""
    args = [a for a in train_args(tmp_path, tiny_model, name="m", max_steps=1, mix="natural",
                                  batch_size=64, dataset=f"{ROOT}/data/sample/*/train-*.jsonl",
                                  val_dataset=f"{ROOT}/data/sample/*/val-*.jsonl")
            if not a.startswith("--val-batches")]
    result = train(args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "holds only" not in result.stderr
    asked = train([*args, "--val-batches=16", "--experiment-name=m2"])
    assert "holds only" in asked.stderr
