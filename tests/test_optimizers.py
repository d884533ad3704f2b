"""Several optimizers (train_llm.build_optimizers returns a list): --optimizer muon trains Muon
on the hidden matrices and AdamW on the rest; every optimizer and schedule is stepped, saved and
restored, each one's learning rate is logged, and a killed Muon run resumes to the very bits."""

import copy

import pytest
import torch
from helpers import (
    ROOT,
    assert_same_run,
    metrics,
    refused,
    straight_and_killed,
    train,
    train_args,
)
from transformers import AutoConfig, AutoModelForCausalLM

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


def test_muon_with_fsdp_is_refused_at_start():
    with pytest.raises(SystemExit):
        train_llm.parse_args(["-e", "x", "--optimizer", "muon", "--fsdp"])


@pytest.mark.slow
def test_a_killed_muon_run_resumes_bit_identically_and_keeps_its_optimizer(tiny_model,
                                                                          tmp_path):
    def muon(name, **overrides):
        return train_args(tmp_path, tiny_model, name, optimizer="muon", **overrides)

    straight, killed, resumed = straight_and_killed(muon, tmp_path)
    assert {"lr/muon", "lr/adamw"} <= set(metrics(straight)[0])
    assert resumed == [10]
    assert_same_run(killed, straight)
    refused(train(train_args(tmp_path, tiny_model, "killed", max_steps=40)), "--optimizer",
            "'muon'")


def test_two_optimizers_of_one_class_log_each_its_lr():
    two = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr) for lr in (0.1, 0.2)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in two]
    assert train_llm.update(two, schedules) == {"lr": 0.1, "lr/sgd0": 0.1, "lr/sgd1": 0.2}
