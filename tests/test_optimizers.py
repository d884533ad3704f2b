"""Several optimizers (train_llm.build_optimizers returns a list): --optimizer muon trains Muon
on the hidden matrices and AdamW on the rest; every optimizer and schedule is stepped, saved and
restored, each one's learning rate is logged; muon.Muon computes torch.optim.Muon's update in
batches; --optimizer auto: a run's own optimizer on resume, Muon for a new run."""

import copy
import json
import shutil

import pytest
import torch
from helpers import ROOT, train
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

import muon
import train_llm
import utils


def small_model():
    config = AutoConfig.from_pretrained(ROOT / "assets/tiny-gpt2", n_layer=2, n_embd=32,
                                        n_head=2, n_positions=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def optimizers_and_schedules(model, optimizer):
    args = train_llm.parse_args(["-e", "x", "--optimizer", optimizer, "--decay-steps", "600"])
    optimizers = train_llm.build_optimizers(model, args)
    schedules = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: train_llm.get_lr(s, args) / args.lr) for o in optimizers]
    return optimizers, schedules


def a_step(model, optimizers, schedules):
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(len(
        [p for o in optimizers for p in o.state])))
    model(input_ids=ids, labels=ids).loss.backward()
    return train_llm.update(optimizers, schedules)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = small_model()
    (muon, adamw), _ = optimizers_and_schedules(model, "muon")
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): name for name, p in model.named_parameters()}
    in_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    in_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert not in_muon & in_adamw and in_muon | in_adamw == set(names.values())
    assert in_muon == {name for name, p in model.named_parameters() if p.dim() == 2
                       and ".h." in name}  # the blocks' matrices: not wte, wpe, biases, norms
    (only,), _ = optimizers_and_schedules(small_model(), "adamw")
    assert isinstance(only, torch.optim.AdamW)


def test_every_optimizer_and_schedule_is_saved_and_restored_and_its_lr_logged():
    """Two steps straight, against one step, a save, a load into fresh objects, one step."""
    model = small_model()
    optimizers, schedules = optimizers_and_schedules(model, "muon")
    lrs = a_step(model, optimizers, schedules)
    assert set(lrs) == {"lr", "lr/muon", "lr/adamw"} and lrs["lr"] == lrs["lr/muon"]
    saved = copy.deepcopy({"model": model.state_dict(), "optimizers": utils.states(optimizers),
                           "schedules": utils.states(schedules)})  # (not the live tensors)
    a_step(model, optimizers, schedules)

    again = small_model()
    again.load_state_dict(saved["model"])
    optimizers, schedules = optimizers_and_schedules(again, "muon")
    utils.load_states(optimizers, saved["optimizers"], "optimizer.pt")
    utils.load_states(schedules, saved["schedules"], "lr_scheduler.pt")
    a_step(again, optimizers, schedules)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(SystemExit, match="optimizer.pt holds 2 state.* builds 1"):
        utils.load_states(optimizers[:1], saved["optimizers"], "optimizer.pt")


def muon_pair(shapes, **options):
    """muon.Muon and torch.optim.Muon, each over its own copy of the same random matrices."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return muon.Muon(ours, **options), torch.optim.Muon(theirs, **options)


@pytest.mark.parametrize("options", [{"weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"},
                                     {"nesterov": False, "adjust_lr_fn": "original"}])
def test_muon_in_batches_updates_as_torch_optim_muon_does(options):
    """Stacked by shape (tall ones transposed), to the bit; each one's state loads the other's."""
    ours, theirs = muon_pair([(16, 48), (16, 48), (48, 16), (16, 16), (64, 16), (48, 16)],
                             lr=0.02, **options)
    for _ in range(3):
        for p, q in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
        for p, q in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
            assert torch.equal(p, q)
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())


def dispatched_ops(optimizer):
    """The tensor operations that are not views (on a GPU: kernel launches) of a step of
    ``optimizer`` after its first (which makes the state)."""
    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.extend([] if func.is_view else [func])
            return func(*args, **(kwargs or {}))

    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()
    with Count():
        optimizer.step()
    return len(ops)


def test_muon_step_dispatches_a_few_ops_per_shape_not_per_matrix():
    """A GPT-2's blocks: 4 matrix shapes each. torch.optim.Muon dispatches ~30 ops per matrix
    (1,376 launches a step for GPT-2 124M); muon.Muon's count does not grow with the blocks."""
    block = [(16, 48), (16, 16), (16, 64), (64, 16)]
    counts = {layers: [dispatched_ops(o) for o in muon_pair(block * layers, lr=0.02)]
              for layers in (1, 3)}
    assert counts[1][0] == counts[3][0] < counts[3][1] and counts[1][1] < counts[3][1]


def test_a_new_run_trains_muon_unless_told(tmp_path):
    """Pretraining and fine-tuning alike (docs/benchmarks.md: Muon is ahead in both)."""
    def optimizer(*flags):
        return train_llm.parse_args(["-e", "x", "--save-dir", str(tmp_path), *flags]).optimizer

    assert optimizer() == optimizer("--task", "sft") == optimizer("--init-from-pretrained")
    assert optimizer() == "muon" and optimizer("--optimizer", "adamw") == "adamw"


# tests/fixtures/release-run: the shipped kit's run before --optimizer auto (AdamW, the default
# then), written at /tmp/fixture-root by this command: 4 steps, a checkpoint each 2.
RELEASE_COMMAND = [
    "-e", "old", "--save-dir", "{root}/outputs", "--model-name", "{root}/model", "--tokenizer",
    "{root}/tokenizer", "--dataset", "{root}/data/train-000.jsonl", "--val-dataset",
    "{root}/data/train-000.jsonl", "-s", "16", "-b", "2", "--max-steps", "4", "--ckpt-freq", "2",
    "--keep-checkpoints", "1", "--val-batches", "1", "--sample-tokens", "0", "--wandb",
    "disabled", "--tokenizer-threads", "1", "--shuffle-buffer", "4"]


def test_a_run_of_the_previous_release_resumes_with_its_optimizer(tmp_path):
    """The same command, --max-steps raised: resumed (not refused), with AdamW alone."""
    root = tmp_path / "release-run"
    shutil.copytree(ROOT / "tests/fixtures/release-run", root)
    for path in root.rglob("*.json"):  # the machine's paths, as if it had been written here
        path.write_text(path.read_text().replace("/tmp/fixture-root", str(root)))
    command = [flag.format(root=root) for flag in RELEASE_COMMAND]
    result = train([*command, "--max-steps", "6"])
    assert result.returncode == 0 and "Resuming" in result.stderr, result.stderr[-2000:]
    run = root / "outputs/old"
    assert json.loads((run / "state.json").read_text())["config"]["optimizer"] == "adamw"
    saved = torch.load(run / "checkpoints/step-000006/optimizer.pt", weights_only=True)
    assert [group["betas"] for group in saved["param_groups"]] == [(0.9, 0.95)] * 2  # AdamW's


def test_a_torn_state_json_still_resumes_with_the_recorded_optimizer(tmp_path):
    """Where state.json is torn, the run resumes from its newest checkpoint: its record counts."""
    shutil.copytree(ROOT / "tests/fixtures/release-run/outputs", tmp_path / "outputs")
    (tmp_path / "outputs/old/state.json").write_text("{")
    args = train_llm.get_parser().parse_args(["-e", "old", "--save-dir", str(tmp_path / "outputs")])
    assert utils.recorded(args, "optimizer", "adamw") == "adamw"
    args.experiment_name = "new"
    assert utils.recorded(args, "optimizer", "adamw") is None


def test_two_optimizers_of_one_class_log_each_its_lr():
    two = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr) for lr in (0.1, 0.2)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in two]
    assert train_llm.update(two, schedules) == {"lr": 0.1, "lr/sgd0": 0.1, "lr/sgd1": 0.2}


def test_each_param_groups_lr_is_logged_where_they_differ():
    """A learner's 10x lr on the embeddings: each group's lr, by its "name" or its index;
    groups that share their lr (AdamW's decayed and not) stay one "lr/<class>"."""
    w = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    groups = torch.optim.AdamW([{"params": w[:1], "lr": 1e-2, "name": "embeddings"},
                                {"params": w[1:2]}], lr=1e-3)
    alike = torch.optim.AdamW([{"params": w[2:3]}, {"params": w[3:], "weight_decay": 0}], lr=1e-3)
    optimizers = [groups, alike]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in optimizers]
    assert train_llm.update(optimizers, schedules) == {
        "lr": 1e-2, "lr/adamw0/embeddings": 1e-2, "lr/adamw0/1": 1e-3, "lr/adamw1": 1e-3}
