"""After training: scripts/export_hf.py (the run's hf/ holds the last checkpoint's weights; a
kill or a full disk leaves no half export; never over what the kit did not write),
scripts/generate.py, and --init-from (its weights exactly, its tokenizer kept)."""

import csv
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ENV,
    ROOT,
    assert_same_run,
    copy_run,
    export,
    metrics,
    read_only,
    refused,
    script,
    script_module,
    small_disk_of,
    snapshot,
    start,
    straight_and_killed,
    train,
    train_args,
    wait_for,
)
from matplotlib.colors import to_hex
from own_model import TinyGPT
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import trained
import utils


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    """A 10-step run with checkpoints at steps 5 and 10, and its hf/."""
    save_dir = tmp_path_factory.mktemp("after")
    result = train(train_args(save_dir, tiny_model, max_steps=10, ckpt_freq=5, val_freq=5))
    assert result.returncode == 0, result.stderr
    assert f"For transformers: python scripts/export_hf.py {save_dir / 'run'}" in result.stderr
    assert not (save_dir / "run/hf").exists()  # training writes checkpoints; the script hf/
    export(save_dir / "run")
    return save_dir / "run"


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
def test_the_hf_export_is_the_last_checkpoint(run_dir, tmp_path, capsys, monkeypatch):
    """{run}/hf/ loads in plain transformers with the last checkpoint's logits; export_hf.py
    exports an older checkpoint, whose logits differ."""
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert AutoTokenizer.from_pretrained(run_dir / "hf").encode("the river")
    ids = torch.arange(3, 35).view(2, 16)
    for step, same in ((10, True), (5, False)):
        model = trained.load_trained(run_dir / f"checkpoints/step-{step:06d}")[0]
        assert torch.equal(logits(model, ids), logits(hf, ids)) == same, step
    out = tmp_path / "old"
    script("export_hf", [run_dir, "--checkpoint", run_dir / "checkpoints/step-000005",
                         "--out", out], capsys, monkeypatch)
    old = trained.load_trained(run_dir / "checkpoints/step-000005")[0]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out), ids), logits(old, ids))


@pytest.mark.slow
def test_an_export_keeps_what_the_user_added(run_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "my-model"
    script("export_hf", [run_dir, "--out", out], capsys, monkeypatch)
    (out / "README.md").write_text("# my model card\n")
    (out / "eval").mkdir()
    (out / "eval/results.json").write_text('{"accuracy": 0.5}')
    script("export_hf", [run_dir, "--checkpoint", run_dir / "checkpoints/step-000005",
                         "--out", out], capsys, monkeypatch)
    assert (out / "README.md").read_text() == "# my model card\n"
    assert json.loads((out / "eval/results.json").read_text()) == {"accuracy": 0.5}
    assert json.loads((out / "train_llm.json").read_text())["exported_from"].endswith(
        "step-000005")


@pytest.mark.slow
def test_generate_is_deterministic_per_seed(run_dir, capsys, monkeypatch):
    def text(model, seed):
        return script("generate", [model, "--prompt", "The river", "--seed", seed,
                                   "--max-new-tokens", 12], capsys, monkeypatch)

    first = text(run_dir, 0)
    assert first.startswith("The river") and len(first) > len("The river\n")
    assert text(run_dir, 0) == first == text(run_dir / "hf", 0)  # the same weights
    assert text(run_dir, 1) != first


@pytest.mark.slow
def test_init_from_a_run_a_checkpoint_or_an_hf_directory(run_dir, tiny_model, tmp_path, capsys,
                                                         monkeypatch):
    """A new run starts from the weights of each kind of source. Its one update at --lr 1e-30
    moves no weight by more than about 1e-30 (below float32's resolution for all but exact
    zeros), so its final weights must equal the source's to that; a fresh model's differ by
    far more. The pretrain -> SFT chain goes through --task sft here."""
    sources = {"run": run_dir, "checkpoint": run_dir / "checkpoints/step-000005",
               "hf": run_dir / "hf"}
    for name, source in sources.items():
        result = train([*train_args(tmp_path, None, name, max_steps=1, lr=1e-30,
                                    min_lr=0, task="sft", seq_length=64),
                        f"--init-from={source}"])
        assert result.returncode == 0, result.stderr
        expected = trained.load_trained(source)[0].state_dict()
        got = utils.load(tmp_path / name / "checkpoints/step-000001/model.pt", "cpu")
        for k in got:
            torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-20, msg=name)
    # The SFT model's prompt is wrapped in the template it was trained with.
    capsys.readouterr()
    for flags, template in (([], True), (["--no-template"], False)):
        out = script("generate", [tmp_path / "run", "--prompt", "Name a color.",
                                  "--max-new-tokens", 5, *flags], capsys, monkeypatch)
        assert ("### Instruction:\nName a color." in out) == template, out


@pytest.mark.slow
def test_an_init_from_run_resumes_exactly_and_its_samples_change_nothing(run_dir, tiny_model,
                                                                          tmp_path):
    """An --init-from run on one file that samples at each validation, killed after step 14
    and resumed, ends bit-identical to a straight run without samples: the resume is exact
    and the sampling (its own RNG) leaves the stream of dropout masks alone. The records a run
    keeps: train.log holds the command and flags and the log of every start."""
    one = tmp_path / "one.jsonl"  # the user's own data, one file (the source ran on shards)
    one.write_text("".join(p.read_text() for p in sorted(ROOT.glob("data/sample/*/train-*"))))

    def run(name):
        return [*train_args(tmp_path, None, name, dataset=one,
                            **({"sample_tokens": 0} if name == "straight" else {})),
                f"--init-from={run_dir}"]

    straight, killed, resumed = straight_and_killed(run, tmp_path, at=14)
    assert resumed == [10]
    assert_same_run(killed, straight)

    samples = {row["step"]: row.get("sample") for row in metrics(tmp_path / "killed")}
    assert all(isinstance(samples[step], str) and samples[step] for step in (10, 20, 30))
    assert samples[10] != samples[30]  # the same seed each time: only the weights changed
    assert not any("sample" in row for row in metrics(tmp_path / "straight"))
    log = (tmp_path / "killed/train.log").read_text()
    assert log.count(f"init_from='{run_dir}'") == 2 and log.count("--init-from=") == 2
    assert log.count("Starting") == 1 and log.count("Resuming") == 1 and "Done: 30" in log


def weights(directory):
    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ctrl_c_during_an_export_is_one_line(four_steps, tmp_path, capsys, monkeypatch):
    """Ctrl-C while export_hf.py works (here: while it loads the checkpoint) ends it with one
    line that says what to do, not a KeyboardInterrupt traceback."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import project

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(project, "load_trained", interrupted)
    try:
        with pytest.raises(SystemExit, match=r"Stopped \(Ctrl-C\)\. The same command exports"):
            script("export_hf", [copy_run(four_steps, tmp_path)], capsys, monkeypatch)
    except KeyboardInterrupt:  # (not this session's: pytest would stop every test)
        pytest.fail("export_hf.py let a KeyboardInterrupt through")


def test_an_export_never_replaces_what_it_did_not_write(four_steps, tmp_path, capsys,
                                                        monkeypatch):
    """`export_hf.py RUN --out DIR` where DIR is not an export of the kit (the directory of
    every run under outputs/, a run itself, its checkpoints): refused, nothing changed."""
    exp = copy_run(four_steps, tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    for out in (tmp_path, exp, exp / "checkpoints"):
        with pytest.raises(SystemExit) as exit_:
            script("export_hf", [exp, "--out", out], capsys, monkeypatch)
        assert "is not an export of this kit" in str(exit_.value.code), out
    assert snapshot(tmp_path) == before
    # An earlier export, and the debris of a killed one, are replaced.
    out = tmp_path / "export"
    script("export_hf", [exp, "--out", out], capsys, monkeypatch)
    (tmp_path / "export.tmp").mkdir()
    (tmp_path / "export.tmp" / trained.EXPORT_MARKER).write_text("{}")
    script("export_hf", [exp, "--checkpoint", exp / "checkpoints/step-000002", "--out", out],
           capsys, monkeypatch)
    assert not (tmp_path / "export.tmp").exists()
    assert same_weights(weights(out), trained.load_trained(exp / "checkpoints/step-000002")[0]
                        .state_dict())


@pytest.mark.slow
def test_export_hf_without_out_writes_only_a_run_s_own_hf_and_never_beside_its_training(
        four_steps, tmp_path, capsys, monkeypatch):
    """A checkpoint directory is no run: no hf/ inside it. A run whose lock is held (it is
    training, and may be exporting) is left alone."""
    exp = copy_run(four_steps, tmp_path)
    ckpt = exp / "checkpoints/step-000002"
    with pytest.raises(SystemExit, match="is no run directory: pass --out"):
        script("export_hf", [ckpt], capsys, monkeypatch)
    assert not (ckpt / "hf").exists()
    before = snapshot(exp / "hf")
    with open(exp / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run training there holds it
        with pytest.raises(SystemExit, match="is training, or being exported .*: export it"):
            script("export_hf", [exp], capsys, monkeypatch)
    assert snapshot(exp / "hf") == before


def test_an_export_of_a_run_that_does_not_exist_says_so_and_names_runs_near_it(
        tmp_path, capsys, monkeypatch):
    """`export_hf.py outputs/demoo`: no such run (not "pass --out"), with the runs whose names
    are near it; nothing written."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo/state.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        script("export_hf", [tmp_path / "demoo"], capsys, monkeypatch)
    message = str(exit_.value.code)
    for words in (f"{tmp_path / 'demoo'}: no such run directory", "near it: demo"):
        assert words in message, (words, message)
    assert "--out" not in message and sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_an_export_to_an_out_another_export_is_writing_says_so_and_leaves_it(
        tmp_path, capsys, monkeypatch):
    """Two exports to one --out at once: the one that finds OUT.tmp held (flock, as a running
    export holds it) says another export is writing there, before it loads the model (or,
    loaded, as it would start to write), and leaves that export's files be; once that export
    has ended, an export claims OUT.tmp, what the other left there deleted."""
    run, out, tmp = tmp_path / "run", tmp_path / "out", tmp_path / "out.tmp"
    (run / "checkpoints").mkdir(parents=True)
    (run / "state.json").write_text("{}")
    tmp.mkdir()
    (tmp / trained.EXPORT_MARKER).write_text("{}")  # (what the other export has written so far)
    export_hf, before = script_module("export_hf"), snapshot(tmp_path)
    other = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as exit_:  # (a run it cannot load: refused before)
            script("export_hf", [run, "--out", out], capsys, monkeypatch)
        with pytest.raises(export_hf.ExportBusy):  # (the race: loaded while the other began)
            export_hf.save_hf(out, None, None, {})
    finally:
        os.close(other)  # (the other export ends, or is killed)
    assert f"another export is writing {out} now" in str(exit_.value.code)
    assert snapshot(tmp_path) == before and not out.exists()
    os.close(export_hf.claim(tmp, out))
    assert tmp.is_dir() and not any(tmp.iterdir())


@pytest.mark.slow
def test_an_export_cut_short_by_a_kill_is_mended_by_the_same_command(four_steps, tmp_path,
                                                                      capsys, monkeypatch):
    """What a kill during export_hf.py leaves: the previous export's hf/ (of step 2) without
    its marker, as a kill while it was being replaced could leave it, and a half-written
    hf.tmp. The same command writes hf/ of the last checkpoint over both."""
    exp = copy_run(four_steps, tmp_path)
    shutil.rmtree(exp / "hf")
    script("export_hf", [exp, "--checkpoint", exp / "checkpoints/step-000002", "--out",
                         exp / "hf"], capsys, monkeypatch)
    (exp / "hf" / trained.EXPORT_MARKER).unlink()
    (exp / "hf.tmp").mkdir()  # debris of an export that wrote its marker last
    (exp / "hf.tmp" / "config.json").write_text("{}")
    script("export_hf", [exp], capsys, monkeypatch)
    assert not (exp / "hf.tmp").exists()
    assert same_weights(weights(exp / "hf"),
                        trained.load_trained(exp / "checkpoints/step-000004")[0].state_dict())
    assert json.loads((exp / "hf" / trained.EXPORT_MARKER).read_text())["exported_from"] == \
        "checkpoints/step-000004"


@pytest.mark.slow
def test_a_full_disk_during_the_export_is_one_paragraph(four_steps, tmp_path, capsys, monkeypatch):
    """export_hf.py on a disk that fills: one paragraph, nothing half-written left, and the
    same command once there is room writes the whole export."""
    exp = copy_run(four_steps, tmp_path)
    shutil.rmtree(exp / "hf")
    limit = (exp / "checkpoints/step-000004/model.pt").stat().st_size // 2
    result = subprocess.run([sys.executable, "scripts/export_hf.py", str(exp)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=120,
                            preexec_fn=small_disk_of(limit))
    refused(result, f"writing {exp / 'hf'} failed", "GiB free on that disk")
    assert not (exp / "hf").exists() and not (exp / "hf.tmp").exists()
    script("export_hf", [exp], capsys, monkeypatch)
    assert same_weights(weights(exp / "hf"),
                        trained.load_trained(exp / "checkpoints/step-000004")[0].state_dict())


@pytest.mark.slow
def test_a_run_from_another_runs_weights_keeps_that_runs_tokenizer(tmp_path, tiny_model):
    """A run ("pre") trained with another tokenizer (the shipped one with two ids swapped): the
    SFT run from it uses that one unless told otherwise, and refuses one that differs."""
    other = tmp_path / "other-tokenizer"
    shutil.copytree(ROOT / "assets/tokenizer", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    pre = train(train_args(tmp_path, tiny_model, name="pre", max_steps=2, ckpt_freq=2,
                           tokenizer=str(other)))
    assert pre.returncode == 0, pre.stderr[-2000:]
    args = train_args(tmp_path, None, name="sft", max_steps=1, task="sft", seq_length=64,
                      init_from=str(tmp_path / "pre"))
    result = train(args)
    assert result.returncode == 0, result.stderr[-2000:]
    state = json.loads((tmp_path / "sft/state.json").read_text())
    assert state["config"]["tokenizer"] == str(other)
    refused(train([*train_args(tmp_path, None, name="sft2", max_steps=1, task="sft",
                               seq_length=64, init_from=str(tmp_path / "pre")),
                   f"--tokenizer={ROOT / 'assets/tokenizer'}"]),
            "is not the tokenizer that --init-from", str(other))


def test_plot_metrics_of_a_run_without_steps_is_one_paragraph(tmp_path):
    """plot_metrics.py on a path that is no run, and on a run whose metrics.jsonl holds no
    step (empty, or only a user's note): an exit that names the file, no traceback."""
    def plot(exp):
        return subprocess.run([sys.executable, "scripts/plot_metrics.py", str(exp)], cwd=ROOT,
                              env=ENV, capture_output=True, text=True)

    refused(plot(tmp_path / "nonexistent"), f"{tmp_path / 'nonexistent' / 'metrics.jsonl'}",
            "no such file")
    (tmp_path / "metrics.jsonl").write_text('{"note": "lr looked high"}\n"a string"\n')
    refused(plot(tmp_path), f"{tmp_path / 'metrics.jsonl'} holds no step yet")


def test_plot_metrics_draws_several_runs_on_the_same_axes(tmp_path):
    """Runs to compare (two optimizers, two seeds): one image, each run's curves labeled with
    its name; several runs need --out."""
    for name, loss in (("adamw", 5.0), ("muon", 4.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": loss - s / 10, "tokens_per_s": 1000.0,
                        **({"val_loss": loss} if s % 5 == 0 else {})}) + "\n"
            for s in range(1, 11)))
    result = subprocess.run([sys.executable, "scripts/plot_metrics.py", tmp_path / "adamw",
                             tmp_path / "muon", "--out", tmp_path / "both.png"], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "both.png").stat().st_size > 0
    refused(subprocess.run([sys.executable, "scripts/plot_metrics.py", tmp_path / "adamw",
                            tmp_path / "muon"], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=60), "several runs: pass --out")


def fake_run(exp_dir, final_val_loss=5.0, seed=0, **config):
    """A run directory as train_llm.py leaves it, for plot_metrics.py: 4 steps of metrics
    (validations at 2 and 4, the last ``final_val_loss``) and a state.json whose config is
    ``config`` with ``seed``."""
    exp_dir.mkdir()
    (exp_dir / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": final_val_loss + 1 - s / 4, "tokens_per_s": 1000.0 + seed,
         **({"val_loss": final_val_loss + (4 - s) / 4} if s % 2 == 0 else {})}) + "\n"
        for s in range(1, 5)))
    (exp_dir / "state.json").write_text(json.dumps(
        {"global_step": 4, "decay_steps": 4, "config": {"lr": 0.004, **config, "seed": seed,
                                                          "file_digests": {"a": "1"}}}))
    return exp_dir


def test_plot_metrics_tells_twelve_runs_apart_with_a_legend_outside_the_axes(tmp_path):
    """12 runs of 12 learning rates: 12 looks (colour, line style), none twice, and a legend
    naming each, outside every axes (covering no point) and inside the figure."""
    plot = script_module("plot_metrics")
    runs = [fake_run(tmp_path / f"lr{i}", lr=(i + 1) / 1000) for i in range(12)]
    fig = plot.figure(plot.group_runs(runs))
    fig.canvas.draw()
    looks = {line.get_label(): (to_hex(line.get_color()), line.get_linestyle())
             for line in fig.axes[0].lines if not line.get_label().startswith("_")}
    assert sorted(looks) == sorted(f"lr={(i + 1) / 1000}" for i in range(12))
    assert len(set(looks.values())) == 12, looks
    [legend] = fig.legends
    assert set(looks) <= {text.get_text() for text in legend.get_texts()}
    box = legend.get_window_extent()
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and \
        box.y1 <= fig.bbox.y1
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)


def test_plot_metrics_draws_and_tables_seeds_of_a_configuration_as_mean_and_spread(
        tmp_path, capsys, monkeypatch):
    """Three seeds of AdamW and two of Muon (given interleaved): two configurations, each
    drawn as the mean of its seeds with a band from their minimum to their maximum; the table
    (printed, and --table as CSV) holds each one's final metrics as mean and sd over seeds."""
    finals = {"adamw": [5.0, 5.2, 5.6], "muon": [4.0, 4.4]}
    runs = {name: [fake_run(tmp_path / f"{name}-s{seed}", value, seed, optimizer=name)
                   for seed, value in enumerate(values)] for name, values in finals.items()}
    plot = script_module("plot_metrics")
    groups = plot.group_runs([*sorted(runs["adamw"] + runs["muon"], key=lambda d: d.name[-1])])
    assert [(label, len(members)) for label, members in groups] == [
        ("optimizer=adamw", 3), ("optimizer=muon", 2)]
    ax = plot.figure(groups).axes[0]
    assert len(ax.collections) == 4  # a band each: train and validation loss, 2 groups
    validation = [line for line in ax.lines if line.get_marker() == "o"]
    for line, values in zip(validation, finals.values()):
        assert line.get_ydata()[-1] == pytest.approx(statistics.mean(values))
    printed = script("plot_metrics", [*runs["adamw"], *runs["muon"], "--out",
                                      tmp_path / "seeds.png", "--table", tmp_path / "t.csv"],
                     capsys, monkeypatch)
    with open(tmp_path / "t.csv") as f:
        table = {row["configuration"]: row for row in csv.DictReader(f)}
    for name, values in finals.items():
        row = table[f"optimizer={name}"]
        assert row["runs"].split() == [d.name for d in runs[name]]
        assert float(row["val_loss_mean"]) == pytest.approx(statistics.mean(values))
        assert float(row["val_loss_sd"]) == pytest.approx(statistics.stdev(values))
        assert f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}" in printed
    assert (tmp_path / "seeds.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("given, words", [
    ("/nope.py", ["--script /nope.py: no such file"]),
    ("data.py", ["data.py has no create_model", "train_llm.py"]),
])
def test_generate_with_a_script_that_cannot_build_the_model_is_one_paragraph(four_steps,
                                                                             given, words):
    result = subprocess.run([sys.executable, "scripts/generate.py", str(four_steps),
                             "--prompt", "The", "--script", given], cwd=ROOT, env=ENV,
                            capture_output=True, text=True)
    refused(result, *words)


@pytest.mark.slow
def test_generate_with_weights_that_are_not_weights_says_so(four_steps):
    """--weights optimizer names a file of the run's that holds no model weights: said so,
    not "put back the create_model" (nothing is wrong with it); --weights of a state the run
    never saved is said to be missing."""
    result = subprocess.run([sys.executable, "scripts/generate.py", str(four_steps),
                             "--prompt", "The", "--weights", "optimizer"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True)
    refused(result, "optimizer.pt is the optimizer state of the run, not a model's weights")
    assert "create_model" not in result.stderr
    result = subprocess.run([sys.executable, "scripts/generate.py", str(four_steps),
                             "--prompt", "The", "--weights", "ema"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True)
    refused(result, "holds no weights named 'ema'")


def test_a_checkpoint_its_run_deletes_while_it_is_read_is_not_called_damaged(ten_steps,
                                                                             tmp_path,
                                                                             monkeypatch):
    """A run that keeps only its newest checkpoint deletes the one a reader (generate,
    export_hf, evaluate, --init-from) resolved, after it wrote a newer one: the reader reads
    that one. Named by its own path, the deleted checkpoint is said to be gone, not damaged."""
    run = copy_run(ten_steps, tmp_path)
    newer = json.loads((run / "state.json").read_text())
    older = {**newer, "global_step": 5, "checkpoint": "checkpoints/step-000005"}
    (run / "state.json").write_text(json.dumps(older))  # (as it was before step 10's save)
    (run / "checkpoints/step-000010").rename(run / "step-000010.tmp")
    weights, calls = trained.checkpoint_weights, []

    def rotated(ckpt_dir, *args):  # the run saves step 10, then deletes step 5 (utils order)
        if not calls:
            (run / "step-000010.tmp").rename(run / "checkpoints/step-000010")
            (run / "state.json").write_text(json.dumps(newer))
            (run / "checkpoints/step-000005").rename(run / "checkpoints/step-000005.deleted")
        calls.append(ckpt_dir.name)
        return weights(ckpt_dir, *args)

    monkeypatch.setattr(trained, "checkpoint_weights", rotated)
    model, _, _, read = trained.load_trained(run)
    assert calls == ["step-000005", "step-000010"] and read.name == "step-000010"
    expected = utils.load(run / "checkpoints/step-000010/model.pt", "cpu")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    (run / "checkpoints/step-000010").rename(run / "checkpoints/gone")
    calls.clear()
    monkeypatch.setattr(trained, "checkpoint_weights", lambda ckpt_dir, *args: (
        ckpt_dir.rename(ckpt_dir.with_name("step-000010.deleted")), weights(ckpt_dir))[1])
    (run / "checkpoints/gone").rename(run / "checkpoints/step-000010")
    with pytest.raises(FileNotFoundError, match="step-000010 was deleted while it was read"):
        trained.load_trained(run / "checkpoints/step-000010")


@pytest.mark.slow
def test_export_and_generate_of_a_run_that_rotates_its_checkpoints_as_it_trains(tmp_path):
    """A run saving every step and keeping one checkpoint: export_hf.py and generate.py of it,
    while it trains, read its newest complete checkpoint, never "damaged" (the export names the
    checkpoint it holds)."""
    args = train_args(tmp_path, ROOT / "assets/tiny-gpt2", name="rot", max_steps=100_000,
                      ckpt_freq=1, keep_checkpoints=1, val_freq=100_000, sample_tokens=0)
    proc = start(args, tmp_path / "log.txt")
    try:
        wait_for(lambda: (tmp_path / "rot/checkpoints/step-000003").exists() or
                 (tmp_path / "rot/checkpoints/step-000004").exists(), proc)
        for n in range(2):
            result = train([tmp_path / "rot", "--out", tmp_path / f"e{n}"],
                           script="scripts/export_hf.py")
            assert result.returncode == 0, result.stderr
            exported = json.loads((tmp_path / f"e{n}" / trained.EXPORT_MARKER).read_text())
            assert "/rot/checkpoints/step-" in exported["exported_from"]
        result = train([tmp_path / "rot", "--prompt", "The", "--max-new-tokens", "2"],
                       script="scripts/generate.py")
        assert result.returncode == 0, result.stderr
        assert proc.poll() is None  # (it was training all along)
    finally:
        proc.kill()


def test_generate_past_the_models_positions_says_what_it_cut(tiny_model, caplog):
    """A prompt and --max-new-tokens longer than the model's positions (64 here): the prompt's
    end and a capped count are generated, and the log says so in numbers."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)).eval()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    prompt = " ".join(["river"] * 100)
    n = len(tokenizer.encode(prompt, add_special_tokens=False)) + 1  # (+ BOS)
    trained.generate(model, tokenizer, prompt, max_new_tokens=1000, temperature=0)
    assert f"The prompt's {n:,} tokens and 1,000 new ones pass the model's 64 positions: " \
           "generating 63 after the prompt's last 1" in caplog.text
    assert "indexing errors" not in caplog.text


def test_a_hugging_face_directory_that_loads_as_another_model_is_refused(tiny_model, tmp_path):
    """A directory whose weights transformers would not all use (an export of adapters, say):
    generate.py and evaluate.py refuse it by name, never run a half-random model."""
    from safetensors.torch import load_file, save_file
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)).save_pretrained(
        tmp_path)
    AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = next(k for k in weights if k.endswith("attn.c_attn.weight"))
    weights[name.replace("c_attn.weight", "c_attn.base.weight")] = weights.pop(name)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=r"makes 1 of its weights at random and drops 1"):
        trained.load_trained(tmp_path)


@pytest.mark.slow
def test_an_init_from_run_whose_weights_do_not_fit_its_source_says_why_and_which(
        run_dir, tmp_path):
    """An --init-from run is rebuilt as its source's model: weights of a model changed after
    loading (adapters) do not fit it, and the paragraph names the keys and the way out, not
    "put back the create_model" (its create_model never built it)."""
    result = train(train_args(tmp_path, None, name="sft", max_steps=1, init_from=run_dir))
    assert result.returncode == 0, result.stderr
    weights = tmp_path / "sft/checkpoints/step-000001/model.pt"
    state = torch.load(weights, weights_only=True)
    name = next(k for k in state if k.endswith("attn.c_attn.weight"))
    state[name.replace("c_attn.weight", "c_attn.base.weight")] = state.pop(name)
    torch.save(state, weights)
    with pytest.raises(OSError) as failed:
        trained.load_trained(tmp_path / "sft")
    for words in (f"1 missing (e.g. {name})", "1 unexpected (e.g. " + name.replace(
            "c_attn.weight", "c_attn.base.weight"), "rebuilt as its source's model", "--script"):
        assert words in str(failed.value), (words, str(failed.value))


@pytest.mark.slow
def test_a_run_whose_init_from_source_is_gone_says_so_and_what_to_do(four_steps, tmp_path):
    """generate.py of a run started from another run that was moved since, export_hf.py of one
    started from an hf/ directory deleted since (its tokenizer too): one paragraph naming the
    source and the ways on (put it back; --script where the tokenizer is not the source's), not
    a FileNotFoundError of the source; nothing exported."""
    for kind, command in (("run", ["generate", "--prompt", "The"]), ("hf", ["export_hf"])):
        source = Path(shutil.copytree(four_steps / ("hf" if kind == "hf" else ""),
                                      tmp_path / f"source-{kind}"))
        result = train(train_args(tmp_path, None, name=kind, max_steps=1, init_from=source))
        assert result.returncode == 0, result.stderr
        if kind == "run":
            source.rename(tmp_path / "moved")
        else:
            shutil.rmtree(source)
        result = train([tmp_path / kind, *command[1:]], script=f"scripts/{command[0]}.py")
        refused(result, f"started from {source} (--init-from), which is gone",
                f"Put {source} back")
        assert ("--script" in result.stderr) == (kind == "run"), result.stderr
        assert ("its tokenizer is the source's" in result.stderr) == (kind == "hf")
    assert not (tmp_path / "hf/hf").exists()


def test_an_export_and_a_loaded_model_generate_with_the_kv_cache(four_steps, tmp_path):
    """Training runs without a KV cache; its export and what load_trained returns generate
    with one (config.json and generation_config.json say use_cache), to the same greedy
    tokens as without it. An export written with use_cache off loads with it on."""
    hf = four_steps / "hf"
    for name in ("config.json", "generation_config.json"):
        assert json.loads((hf / name).read_text())["use_cache"] is True, name
    model = AutoModelForCausalLM.from_pretrained(hf).eval()  # as any user loads it
    ids = torch.tensor([[0, 5, 300, 17]])
    cached, uncached = (model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=12, min_new_tokens=12, use_cache=use,
                                       output_logits=True, return_dict_in_generate=True)
                        for use in (True, False))
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits))
    old = shutil.copytree(hf, tmp_path / "old")
    for name in ("config.json", "generation_config.json"):
        (old / name).write_text(json.dumps({**json.loads((old / name).read_text()),
                                            "use_cache": False}))
    for source in (old, four_steps, four_steps / "checkpoints/step-000002"):
        loaded = trained.load_trained(source)[0]
        assert loaded.config.use_cache and loaded.generation_config.use_cache, source
    own = TinyGPT(vocab_size=8)  # no such notion: left as it is
    assert trained.with_cache(own) is own and not hasattr(own, "config")


def test_plot_metrics_replaces_only_its_own_images_and_says_what_it_wrote(tmp_path):
    """A user's fig.png, or a file that is no image, is never replaced (one paragraph, the file
    unchanged); the script's own image is, at a rerun; --out x writes and names x.png; an --out
    that is no PNG is refused before any work."""
    def plot(*flags):
        return subprocess.run([sys.executable, "scripts/plot_metrics.py", run, *flags], cwd=ROOT,
                              env=ENV, capture_output=True, text=True, timeout=60)

    run = fake_run(tmp_path / "run")
    users = tmp_path / "fig.png"
    plt = pytest.importorskip("matplotlib.pyplot")
    plt.figure().savefig(users)  # (a Matplotlib PNG of the user's own)
    before = users.read_bytes()
    refused(plot("--out", users), "no image of plot_metrics.py", "nothing was replaced")
    assert users.read_bytes() == before
    (run / "metrics.png").write_text("my notes")
    refused(plot(), "no image of plot_metrics.py")
    assert (run / "metrics.png").read_text() == "my notes"
    result = plot("--out", tmp_path / "x")
    assert result.returncode == 0 and str(tmp_path / "x.png") in result.stdout, result.stderr
    assert plot("--out", tmp_path / "x.png").returncode == 0  # its own: replaced
    refused(plot("--out", tmp_path / "x.txt"), "the image is a PNG")


def test_plot_metrics_refuses_what_it_cannot_write_or_read_before_drawing(tmp_path, capsys,
                                                                          monkeypatch):
    """--out in a folder that does not exist, a run directory it may not write metrics.png in,
    a byte of metrics.jsonl that is no UTF-8: one paragraph each, naming the path (and the
    line) and what to do; nothing drawn, and the first two refused before any is read."""
    plot = script_module("plot_metrics")
    group_runs = plot.group_runs  # (the runs' metrics read: None where refused before it)

    def refusal(*argv, reads=True):
        monkeypatch.setattr(sys, "argv", ["plot_metrics.py", *map(str, argv)])
        monkeypatch.setattr(plot, "group_runs", group_runs if reads else None)
        with pytest.raises(SystemExit) as exit_:
            plot.main()
        return f"{exit_.value.code} {capsys.readouterr().err}"

    run = fake_run(tmp_path / "run")
    message = refusal(run, "--out", tmp_path / "nodir/x.png", reads=False)
    for words in (f"--out {tmp_path / 'nodir/x.png'}", f"no folder {tmp_path / 'nodir'}",
                  "mkdir -p", "nothing was drawn"):
        assert words in message, (words, message)
    assert not (tmp_path / "nodir").exists()
    with read_only(fake_run) as ro:
        message = refusal(ro, reads=False)
    for words in (f"{ro / 'metrics.png'}: cannot write in {ro} (Permission denied)",
                  "Pass --out"):
        assert words in message, (words, message)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 5, "note": "caf\xe9"}\n')  # (Latin-1, not UTF-8)
    message = refusal(run)
    for words in (f"{run / 'metrics.jsonl'}, line 5: byte 0xe9 is not UTF-8",
                  "Mend or delete that line"):
        assert words in message, (words, message)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "state.json"]


def test_an_export_of_a_run_takes_only_that_runs_checkpoints(four_steps, tmp_path, capsys,
                                                             monkeypatch):
    """`export_hf.py A --checkpoint B/checkpoints/step-000004`: refused before any work,
    naming the checkpoint; A's hf/ is not written with B's model."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = copy_run(four_steps, tmp_path / "a"), copy_run(four_steps, tmp_path / "b")
    shutil.rmtree(a / "hf")
    with pytest.raises(SystemExit) as exit_:
        script("export_hf", [a, "--checkpoint", b / "checkpoints/step-000004"], capsys,
               monkeypatch)
    assert "is not one of" in str(exit_.value.code) and not (a / "hf").exists()
