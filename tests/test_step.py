"""The training step: the same update however the global batch is cut (micro-batches, ranks),
packed samples that do not see each other, and a loss that equals cross-entropy without
float32 copies of all the logits."""

import itertools
import math
import os
import socket
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import ENV, ROOT, copy_kit, metrics, train, train_args
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import train_llm
import utils

SEQ, GLOBAL = 24, 8


def small_model(seed=0):
    config = AutoConfig.from_pretrained(
        os.path.join(os.path.dirname(__file__), "../assets/tiny-gpt2"), n_layer=2, n_embd=32,
        n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def sft_batch():
    """Eight SFT sequences whose answers (the scored tokens) run from 1 to 20 tokens: a mean
    per micro-batch weighs them very differently from a mean over the step's tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 8192, (GLOBAL, SEQ), generator=g)
    labels = ids.clone()
    for row, answer in enumerate((1, 20, 2, 15, 3, 3, 18, 1)):
        labels[row, :SEQ - answer] = -100
    return {"input_ids": ids, "labels": labels}


def one_step(model, batch, rows, micro, ctx):
    """One AdamW step on ``rows`` of the batch, cut into micro-batches of ``micro`` rows; the
    weights after it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{k: v[i:i + micro] for k, v in batch.items()} for i in range(*rows, micro)]
    stats = train_llm.train_step(model, batches, ctx, train_llm.sequence_losses)
    optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), stats["loss"]


def share_off(a, b):
    """The share of weights that differ by more than float noise."""
    return ((a - b).abs() > 1e-6).float().mean().item()


def ddp_rank(rank, port, out):
    """Rank ``rank`` of two: DDP over gloo, its half of the batch as one micro-batch."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(small_model())
    ctx = train_llm.Context(rank, 2, torch.device("cpu"), True)
    weights, loss = one_step(model, sft_batch(), (4 * rank, 4 * rank + 4), 4, ctx)
    numbers = utils.StepNumbers(ctx)
    numbers.add({"loss": loss, "grad_norm": torch.tensor(0.0)}, {"step": 1})
    [(numbers, _)] = numbers.ready(wait=True)  # summed over the two ranks
    loss = numbers["loss"]
    if rank == 0:
        torch.save({"weights": weights, "loss": loss}, out)
    dist.barrier()
    # Straight out: tearing down a gloo group under a DDP model can deadlock on the GIL
    # (the group's worker thread frees a tensor while the main thread joins it).
    os._exit(0)


def test_sft_step_is_the_same_however_the_global_batch_is_cut(tmp_path):
    """8 x 1, 4 x 2, 2 x 4 on one rank and 2 ranks x (4 x 1) under DDP: the same weights after
    one step (<= 0.01% of them off by > 1e-6) and the same logged loss. A loss averaged per
    micro-batch, not over the step's scored tokens, moves a fifth of the weights otherwise at
    4 x 2."""
    ctx = train_llm.Context(0, 1, torch.device("cpu"), False)
    expected, loss = one_step(small_model(), sft_batch(), (0, GLOBAL), 8, ctx)
    for micro in (4, 2):
        weights, micro_loss = one_step(small_model(), sft_batch(), (0, GLOBAL), micro, ctx)
        assert share_off(weights, expected) <= 1e-4, micro
        assert micro_loss.item() == pytest.approx(loss.item(), rel=1e-5)

    with socket.socket() as s:  # a free port on loopback for the two ranks to meet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.start_processes(ddp_rank, args=(port, tmp_path / "rank0.pt"), nprocs=2,
                               join=False)
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=1):  # raises if a rank failed; never waits forever
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two DDP ranks did not finish")
    ddp = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert share_off(ddp["weights"], expected) <= 1e-4
    assert ddp["loss"] == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch.compile on CPU takes minutes"))])
def test_packed_samples_do_not_see_each_other(compiled):
    """Two samples packed into one sequence, with position_ids restarting at the second
    (as data.Pack makes them), through the trainer's forward(): changing the first leaves the
    second's logits unchanged, because transformers turns restarting positions into a
    per-sample causal mask (if there is no KV cache: forward passes use_cache=False). Without
    the restart (one long document) the second does see the first. A transformers upgrade or
    a model whose attention ignores packing fails here."""
    device = "cuda" if compiled else "cpu"
    model = small_model().to(device)
    if compiled:
        model.compile()
    first, second = torch.randint(3, 8192, (2, 10)), torch.randint(3, 8192, (12,))
    positions = torch.cat([torch.arange(10), torch.arange(12)]).view(1, -1)

    def logits_of_second(head, packed):
        batch = {"input_ids": torch.cat([head, second]).view(1, -1)}
        if packed:
            batch["position_ids"] = positions
        with torch.no_grad():
            logits = train_llm.forward(model, batch, device)[0]
        return logits[0, 10:].float().cpu()

    for mode in ("train", "eval"):  # train mode is how the loss is made (no dropout here)
        getattr(model, mode)()
        assert torch.allclose(logits_of_second(first[0], True),
                              logits_of_second(first[1], True), atol=1e-5), mode
        assert not torch.allclose(logits_of_second(first[0], False),
                                  logits_of_second(first[1], False), atol=1e-3), mode


def test_activation_checkpointing_gives_the_same_gradients(tiny_model):
    """--activation-checkpointing recomputes activations in backward, dropout masks included
    (non-reentrant checkpointing restores the RNG): the gradients equal those without it."""
    grads = []
    for flags in ([], ["--activation-checkpointing"]):
        args = train_llm.parse_args(["-e", "x", "--model-name", str(tiny_model), "-s", "32",
                                     *flags])
        torch.manual_seed(0)
        _, model = train_llm.build_model(args, torch.device("cpu"))
        assert model.is_activation_checkpointing == bool(flags)
        torch.manual_seed(1)  # the same dropout masks
        one_step(model, sft_batch(), (0, GLOBAL), 4, train_llm.Context(0, 1, torch.device("cpu"),
                                                                         False))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_skipping_the_mask_checks_leaves_the_logits_as_they_were():
    """utils.skip_mask_checks (no read of the GPU in a forward): through the trainer's forward,
    the logits of a plain batch holding the pad token, of a packed batch (padding at its end)
    and of rows of one sample each are transformers' own to the bit, gradients too. A model
    with a sliding window keeps transformers' masks."""
    plain, kit = small_model(), small_model()
    utils.skip_mask_checks(kit)
    assert kit.config._attn_implementation == utils.UNMASKED_SDPA
    assert plain.config._attn_implementation == "sdpa" and plain.config.pad_token_id is not None
    ids = torch.randint(3, 8192, (3, 24))
    ids[:, -1] = plain.config.pad_token_id
    packed = {"input_ids": ids,
              "position_ids": torch.cat([torch.arange(7), torch.arange(13), torch.zeros(4,
                                         dtype=torch.long)]).repeat(3, 1)}
    one_each = {"input_ids": ids, "position_ids": torch.arange(24).repeat(3, 1)}  # full rows
    assert utils.packed_mask(kit, one_each["position_ids"], "cpu") is None  # SDPA's is_causal
    for batch in ({"input_ids": ids}, packed, one_each):
        logits = [train_llm.forward(model, batch, "cpu")[0] for model in (kit, plain)]
        assert torch.equal(logits[0], logits[1])
        for out in logits:
            out.square().mean().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(kit.parameters(),
                                                               plain.parameters()))
        kit.zero_grad(), plain.zero_grad()
    config = AutoConfig.for_model("mistral", vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, sliding_window=4)
    windowed = AutoModelForCausalLM.from_config(config)
    utils.skip_mask_checks(windowed)
    assert windowed.config._attn_implementation == "sdpa"


def test_logged_throughput_is_the_wall_clock_between_log_steps(monkeypatch):
    """tokens/s and the data wait are over all the time between two log lines (validation and
    checkpoints included, and said beside them), as nanoGPT's and torchtitan's are."""
    clock = {"now": 100.0}
    monkeypatch.setattr(utils.time, "perf_counter", lambda: clock["now"])
    timers = {name: utils.Timer() for name in ("data", "validation", "checkpoint")}
    ctx = train_llm.Context(0, 2, torch.device("cpu"), True)
    speed = utils.Throughput(timers, 10_000, flops_per_token=6, ctx=ctx)
    for seconds, timer in ((0.5, "data"), (3.0, "validation"), (1.5, "checkpoint")):
        with timers[timer]:
            clock["now"] += seconds
    clock["now"] += 5.0  # the steps themselves
    metrics = speed.metrics(tokens_seen=20_000)
    assert metrics["tokens_per_s"] == pytest.approx(10 * 1000 / 10.0)
    assert metrics["data_wait"] == pytest.approx(0.05)
    assert metrics["time/validation_s"] == 3.0 and metrics["time/checkpoint_s"] == 1.5
    clock["now"] += 2.0
    metrics = speed.metrics(tokens_seen=25_000)  # from the last call on, timers emptied
    assert metrics["tokens_per_s"] == pytest.approx(5 * 1000 / 2.0) and metrics["data_wait"] == 0


def test_step_numbers_are_read_a_step_late_and_a_checkpoint_reads_its_own():
    """StepNumbers hands back every step but the newest (whose numbers the GPU may still be
    computing), all of them when asked to wait, oldest first."""
    ctx = train_llm.Context(0, 1, torch.device("cpu"), False)
    numbers = utils.StepNumbers(ctx)
    for step in (1, 2, 3):
        numbers.add({"loss": torch.tensor(float(step)), "grad_norm": torch.tensor(1.0),
                     "domain_loss": torch.tensor([step, 2.0 * step])}, {"step": step})
    assert [(n["loss"], m["step"]) for n, m in numbers.ready()] == [(1.0, 1), (2.0, 2)]
    assert list(numbers.ready()) == []
    [(last, metrics)] = numbers.ready(wait=True)
    assert metrics == {"step": 3} and last["domain_loss"] == [3.0, 6.0]


def test_what_a_step_leads_to_is_decided_from_its_numbers(tmp_path):
    """decide: a save every --ckpt-freq steps reads its own step's numbers first; a signal in
    a step's numbers (any rank's) stops the run at the next, saved; a loss that is not finite
    ends it without a checkpoint, naming the last good one."""
    args = train_llm.parse_args(["-e", "x", "--ckpt-freq", "4", "--max-steps", "10"])
    numbers = utils.StepNumbers(train_llm.Context(0, 1, torch.device("cpu"), False))
    state = {"checkpoint": "checkpoints/step-000002"}

    def step(n, loss=1.0, stop=0.0):
        numbers.add({"loss": torch.tensor(loss), "grad_norm": torch.tensor(1.0),
                     "stop": torch.tensor(stop)}, {"step": n})
        return train_llm.decide(n, numbers, state, args, ran_out=False, stop_now=False)

    assert step(1) == train_llm.Move()  # (its numbers may still be computing)
    move = step(2)
    assert [m["step"] for _, m in move.late] == [1] and not move.save and not move.end
    step(3)
    move = step(4)
    assert [m["step"] for _, m in move.late + move.own] == [3, 4] and move.save
    assert not step(5, stop=1.0).end  # (read at the next step)
    move = step(6)
    assert move.save and move.end and state["data_exhausted"] is False
    step(7, loss=math.inf)
    move = step(8)
    assert move.failure.startswith("Step 7: loss inf") and "step-000002" in move.failure
    assert not move.save and not move.late  # (nothing of a diverged step is logged or saved)


def test_label_smoothing_is_the_training_losss_alone():
    """--label-smoothing goes into train_step's loss (compile_model); evaluate's
    sequence_losses stays plain cross-entropy."""
    args = train_llm.parse_args(["-e", "x", "--label-smoothing", "0.1"])
    training = train_llm.compile_model(small_model(), args)
    logits, targets = torch.randn(2, 6, 50), torch.randint(0, 50, (2, 6))
    sums, counts = training(logits, targets)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(),
                               reduction="none", label_smoothing=0.1).view(2, 5).sum(dim=1)
    assert torch.allclose(sums, expected) and counts.tolist() == [5, 5]
    plain, _ = train_llm.sequence_losses(logits, targets)
    assert torch.allclose(plain, F.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), reduction="none").view(
            2, 5).sum(dim=1))


def test_a_models_own_loss_term_joins_the_gradient_and_is_logged_apart():
    """A model whose output carries aux_loss (transformers' Mixtral with output_router_logits,
    weighed by router_aux_loss_coef): train_step's gradient is that of transformers' own loss
    (cross-entropy plus the weighed term), "loss" stays the cross-entropy alone, "aux_loss"
    is the weighed term; cut into micro-batches, the term counts as its mean over them."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    ctx = train_llm.Context(0, 1, torch.device("cpu"), False)

    def fresh():
        torch.manual_seed(0)
        return MixtralForCausalLM(config)

    def grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference = fresh()
    output = reference(input_ids=ids, labels=ids)  # transformers: CE + coef * aux_loss
    output.loss.backward()
    model = fresh()
    stats = train_llm.train_step(model, [{"input_ids": ids}], ctx, train_llm.sequence_losses)
    assert torch.allclose(grads(model), grads(reference), atol=1e-6)
    assert stats["aux_loss"].item() == pytest.approx(0.5 * output.aux_loss.item(), rel=1e-5)
    assert stats["loss"].item() == pytest.approx(output.loss.item() - stats["aux_loss"].item(),
                                                 rel=1e-5)

    halves = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
    terms = [0.5 * fresh()(input_ids=h["input_ids"]).aux_loss.item() for h in halves]
    stats = train_llm.train_step(fresh(), halves, ctx, train_llm.sequence_losses)
    assert stats["aux_loss"].item() == pytest.approx(sum(terms) / 2, rel=1e-5)


def test_a_models_own_loss_term_is_weighed_as_transformers_weighs_it():
    """The weight comes from the model (DBRX keeps router_aux_loss_coef there) or its config
    (Mixtral's router_aux_loss_coef, JetMoE's aux_loss_coef), else 1 (a model of one's own
    returns its term weighed)."""
    def model(on_model=None, **config):
        module = torch.nn.Linear(1, 1)
        module.config = types.SimpleNamespace(**config)
        if on_model is not None:
            module.router_aux_loss_coef = on_model
        return module

    assert utils.aux_loss_weight(model(router_aux_loss_coef=0.02)) == 0.02
    assert utils.aux_loss_weight(model(aux_loss_coef=0.01)) == 0.01
    assert utils.aux_loss_weight(model(0.05, moe_loss_weight=0.01)) == 0.05
    assert utils.aux_loss_weight(model()) == 1


def test_an_moe_that_balances_its_experts_is_refused_for_packed_sft_by_name():
    """transformers' load-balancing loss does not take the attention mask of packed samples
    (it fails on a shape deep in the forward): --task sft says so before training."""
    from transformers import MixtralConfig, MixtralForCausalLM
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True))
    args = train_llm.parse_args(["-e", "x", "--task", "sft"])
    tokenizer = utils.pretrained(AutoTokenizer, args.tokenizer, "--tokenizer")
    with pytest.raises(SystemExit) as stop:
        utils.check_model(model, tokenizer, args)
    assert "output_router_logits" in str(stop.value) and "--task pretrain" in str(stop.value)
    utils.check_model(model, tokenizer, train_llm.parse_args(["-e", "x"]))  # pretraining: fine


@pytest.mark.slow
def test_tokens_are_counted_from_the_batches_a_step_takes(tmp_path, tiny_model):
    """A learner's batch schedule (from step 3 on, each step fetches twice the micro-batches):
    tokens_seen, the tokens/s it is logged with, and the last line count what was trained."""
    script = copy_kit(tmp_path / "kit", script="train_llm.py", edits=[(
        "                batches = fetch(train_loader, args, ctx)  # None: no more\n",
        "                batches = fetch(train_loader, args, ctx)  # None: no more\n"
        "                if batches and step > 2:\n"
        "                    batches += fetch(train_loader, args, ctx) or []\n")])
    args = train_args(tmp_path, tiny_model, max_steps=6, log_freq=1, val_freq=6, ckpt_freq=6,
                      tokenizer=ROOT / "assets/tokenizer", sample_tokens=0,
                      dataset=f"{ROOT}/data/sample/prose/train-000.jsonl",  # (one file)
                      val_dataset=f"{ROOT}/data/sample/prose/val-000.jsonl")
    result = subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    step_tokens = 4 * 32  # --batch-size 4 x --seq-length 32
    expected = list(itertools.accumulate(step_tokens * (1 if s <= 2 else 2) for s in range(1, 7)))
    logged = metrics(tmp_path / "run")
    assert [line["tokens_seen"] for line in logged] == expected
    assert f"{expected[-1]:,} tokens" in result.stderr


@pytest.mark.slow
def test_a_resume_that_cuts_the_global_batch_another_way_says_so(tmp_path, tiny_model):
    """8 x 1 resumed as 4 x 2: the same update up to float rounding, not bit for bit, said in
    one line; resumed with its own cut, nothing is said."""
    args = dict(batch_size=8, grad_accum=1, max_steps=2, ckpt_freq=2, val_freq=10)
    assert train(train_args(tmp_path, tiny_model, **args)).returncode == 0
    same = train(train_args(tmp_path, tiny_model, **dict(args, max_steps=3)))
    assert same.returncode == 0 and "float rounding" not in same.stderr, same.stderr[-2000:]
    cut = train(train_args(tmp_path, tiny_model, **dict(args, batch_size=4, grad_accum=2,
                                                       max_steps=4)))
    assert cut.returncode == 0, cut.stderr[-2000:]
    assert "cut 4 x 2 x 1 rank(s), where it was 8 x 1 x 1: the same update up to float " \
           "rounding" in cut.stderr
