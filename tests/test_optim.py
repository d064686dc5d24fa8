"""Optimizers and schedules: the LR curves against their formulas, resume bit-exactly for every
optimizer x schedule, and Muon under sharding against torch.optim.Muon in one process.

Muon tolerances, from the mechanism (optim/muon.py):
* Same gradients (``mode="grads"``: every rank's shard of one set of float64 gradients): exactly 0.
  Momentum, Nesterov blend, weight decay and update are elementwise (the same bits on a shard as on
  the whole tensor); the gather and scatter only move bfloat16 values (torch's Newton-Schulz casts
  its input to bfloat16 first); the owner runs torch's own function on the very matrix one process
  sees; AdamW's groups are torch's AdamW, elementwise too.
* Training (``mode="train"``, float64 model and loss): the gradients differ only by reduction order,
  ~1e-16 relative. torch's Newton-Schulz rounds its input to bfloat16 (8 bits), so that noise changes
  its result only if an element lies within ~1e-16 of a bfloat16 rounding tie: probability ~2^-45 per
  element, ~1e-8 for this model's ~3e4 matrix elements over 3 steps, so the outputs are equal and
  the parameters differ by the float64 noise alone. Bound 1e-10: float64 rounding (1e-16) amplified by
  at most AdamW's 1/(sqrt(v)+eps) with eps = 1e-8 over a few steps at lr 1e-2 stays far below it,
  while one bfloat16 flip would move a weight by ~lr * 2^-8 = 4e-5.
CI time: ~1 min (one 2-rank and one 4-rank spawn; the resume grid runs in-process).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from shardwise.cli import main
from shardwise.core.config import OptimizerConfig, ScheduleConfig, TrainConfig, load_config
from shardwise.errors import ConfigError
from shardwise.optim.names import OPTIMIZER_NAMES, SCHEDULE_NAMES
from shardwise.optim.schedule import lr_at, set_lr
from shardwise.testing import run_distributed
from tests.helpers.ckpt import cli_args, fast_overrides, final_weights, losses, small_text
from tests.helpers.optim import muon_cases, muon_run, muon_save_or_load, optimizer_bytes_vs_plan

TRAIN_PARAM_TOL = 1e-10
TRAIN_LOSS_TOL = 1e-12


# --------------------------------------------------------------------------- schedules
def test_schedules_follow_their_formulas():
    t = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    for name in SCHEDULE_NAMES:
        s = ScheduleConfig(name=name, decay_fraction=0.3)
        for step in range(10):  # every schedule warms up linearly
            assert lr_at(step, t, s) == pytest.approx((step + 1) / 10, abs=1e-15)
    p = lambda step: min(1.0, (step - 10) / 90)  # noqa: E731
    for step in range(10, 120):
        assert lr_at(step, t, ScheduleConfig("cosine")) == pytest.approx(
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p(step))), abs=1e-15)
        assert lr_at(step, t, ScheduleConfig("linear")) == pytest.approx(0.1 + 0.9 * (1 - p(step)), abs=1e-15)
        assert lr_at(step, t, ScheduleConfig("constant")) == 1.0
        wsd = 1.0 if step < 70 else 0.1 + 0.9 * (1 - min(1.0, (step - 70) / 30))
        assert lr_at(step, t, ScheduleConfig("wsd", decay_fraction=0.3)) == pytest.approx(wsd, abs=1e-15)
    assert lr_at(99, t, ScheduleConfig("wsd", decay_fraction=0.3)) == pytest.approx(0.1 + 0.9 / 30)
    # The default is the trainer's warm-up + cosine, unchanged.
    assert lr_at(40, t) == lr_at(40, t, ScheduleConfig())


def test_group_lr_ratio_and_wsd_refusal():
    t = TrainConfig(steps=10, lr=1.0, min_lr=0.0, warmup_steps=0)
    groups = [{"lr": 0}, {"lr": 0, "lr_ratio": 20.0}]
    set_lr(groups, 0, t, ScheduleConfig("constant"))
    assert [g["lr"] for g in groups] == [1.0, 20.0]
    with pytest.raises(ConfigError, match="decay phase"):
        load_config(None, ["train.steps=10", "train.warmup_steps=5", "schedule.name=wsd",
                           "schedule.decay_fraction=0.8"])
    with pytest.raises(ConfigError, match="optimizer"):
        load_config(None, ["optimizer.name=lion"])


# --------------------------------------------------------------------------- builders
def test_muon_groups_follow_its_authors():
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.optim.build import build_optimizer

    model = GPT(GPT_PRESETS["moe-nano"])
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, TrainConfig(), OptimizerConfig(name="muon", muon_lr=0.02))
    muon = [names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]]
    rest = [names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]]
    assert "blocks.0.attn.q_proj.weight" in muon and "blocks.0.mlp.experts.w_in" in muon
    assert {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"} <= set(rest)
    assert all(n.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) or n in
               ("tok_emb.weight", "pos_emb.weight", "lm_head.weight") for n in rest)
    assert opt.param_groups[0]["lr_ratio"] == pytest.approx(0.02 / TrainConfig().lr)
    from shardwise.optim.adafactor import Adafactor

    for name, cls in (("adamw", torch.optim.AdamW), ("adafactor", Adafactor), ("sgd", torch.optim.SGD)):
        assert type(build_optimizer(model, TrainConfig(), OptimizerConfig(name=name))) is cls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adafactor_in_one_process_equals_torch_adafactor_bit_for_bit(dtype):
    """shardwise's Adafactor is torch's single-tensor rule (out of place where torch squares in place):
    on plain tensors the same parameters and the same state, bit for bit, with weight decay, on
    matrices, vectors and a 3-D stack."""
    from shardwise.optim.adafactor import Adafactor

    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (7,), (2, 3, 4)]
    start = [torch.randn(s, dtype=dtype, generator=gen) for s in shapes]
    ours, ref = ([p.clone().requires_grad_() for p in start] for _ in range(2))
    opts = [cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:]}], lr=1e-2, **kw)
            for cls, ps, kw in ((Adafactor, ours, {}), (torch.optim.Adafactor, ref, {"foreach": False}))]
    for _ in range(5):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn(a.shape, dtype=dtype, generator=gen)
            b.grad = a.grad.clone()
        for opt in opts:
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    mine, theirs = (o.state_dict()["state"] for o in opts)
    assert all(torch.equal(mine[i][k], theirs[i][k]) for i in theirs for k in theirs[i])


def test_muon_in_one_process_equals_torch_muon_bit_for_bit():
    ours, ref = muon_run(0, 1), muon_run(0, 1, reference=True)
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])
    # and the expert stacks are orthogonalised per expert (torch.optim.Muon refuses 3-D tensors)
    moe = muon_run(0, 1, preset="moe-nano", steps=1)
    assert torch.isfinite(moe["params"]["blocks.0.mlp.experts.w_in"]).all()


# --------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_text(tmp_path_factory.mktemp("optim-data"))


@pytest.mark.parametrize("optimizer", OPTIMIZER_NAMES)
def test_each_optimizer_and_schedule_resumes_bit_exactly(optimizer, corpus, tmp_path):
    """4 steps straight vs 2 steps, then resumed from that checkpoint for 2 more, per schedule."""
    for schedule in SCHEDULE_NAMES:
        sets = [*fast_overrides(corpus, steps=4, every=2), f"optimizer.name={optimizer}",
                f"schedule.name={schedule}", "schedule.decay_fraction=0.5", "train.warmup_steps=1"]
        full, part = tmp_path / f"{schedule}-full", tmp_path / f"{schedule}-part"
        base = ["train", "--nproc", "1", "--strategy", "single"]
        assert main([*base, "--out", str(full), *cli_args(sets)]) == 0
        shutil.copytree(full / "checkpoints" / "step-00000002", tmp_path / f"{schedule}-ckpt")
        assert main([*base, "--out", str(part), *cli_args(sets),
                     "--set", f'checkpoint.resume="{tmp_path / f"{schedule}-ckpt"}"']) == 0
        ref, run = losses(full), losses(part)
        assert [run[s] for s in (3, 4)] == [ref[s] for s in (3, 4)], (optimizer, schedule)
        a, b = final_weights(full), final_weights(part)
        assert all(torch.equal(a[k], b[k]) for k in a), (optimizer, schedule)


def test_switching_optimizer_on_resume_is_refused_or_reset(corpus, tmp_path):
    sets = [*fast_overrides(corpus, steps=2, every=2)]
    base = ["train", "--nproc", "1", "--strategy", "single"]
    assert main([*base, "--out", str(tmp_path / "a"), *cli_args(sets)]) == 0
    resume = ["--set", f'checkpoint.resume="{tmp_path / "a"}"', "--set", "train.steps=3"]
    assert main([*base, "--out", str(tmp_path / "b"), *cli_args(sets), *resume,
                 "--set", "optimizer.name=muon"]) != 0
    assert main([*base, "--out", str(tmp_path / "c"), *cli_args(sets), *resume,
                 "--set", "optimizer.name=muon", "--set", "optimizer.on_switch=reset"]) == 0
    assert sorted(losses(tmp_path / "c")) == [3]


# --------------------------------------------------------------------------- Muon under sharding
CASES_2 = {
    "ddp": dict(strategy="ddp"), "zero1": dict(strategy="zero1"), "zero2": dict(strategy="zero2"),
    "fsdp": dict(strategy="fsdp"), "fsdp-llama": dict(strategy="fsdp", hf="llama-tiny"),
    "fsdp+tp": dict(strategy="fsdp+tp", tp=2),
    "train-fsdp-muon": dict(strategy="fsdp", mode="train"),
    # No biases: the attention key bias's true gradient is 0 (softmax is shift-invariant), and
    # Adafactor divides its rounding noise by the noise's own RMS (eps1 ~ 1e-30 in float64), so its
    # update's sign, O(lr), is noise in either run; AdamW's eps = 1e-8 damps the same noise.
    "train-ddp-adafactor": dict(strategy="ddp", mode="train", optimizer="adafactor", overrides={"bias": False}),
    # Sharded Adafactor (optim/adafactor.py): the column statistics and the RMS norms all-reduced.
    "train-fsdp-adafactor": dict(strategy="fsdp", mode="train", optimizer="adafactor", overrides={"bias": False}),
    "train-fsdp-sgd": dict(strategy="fsdp", mode="train", optimizer="sgd"),
}
CASES_4 = {
    "fsdp+tp": dict(strategy="fsdp+tp", tp=2), "fsdp+tp-llama": dict(strategy="fsdp+tp", tp=2, hf="llama-tiny"),
    "fsdp+tp+pp": dict(strategy="fsdp+tp+pp", tp=2, pp=2), "hsdp": dict(strategy="hsdp", hsdp_shard_size=2),
    "ep": dict(strategy="fsdp", ep=2, preset="moe-nano"), "ep4": dict(strategy="fsdp", ep=4, preset="moe-nano"),
    "train-fsdp+tp-muon": dict(strategy="fsdp+tp", tp=2, mode="train"),
    "train-fsdp+tp-adafactor": dict(strategy="fsdp+tp", tp=2, mode="train", optimizer="adafactor",
                                    overrides={"bias": False}),
    "train-ep-adafactor": dict(strategy="fsdp", ep=2, preset="moe-nano", mode="train", optimizer="adafactor",
                               overrides={"bias": False}),
}


def _reference(case: dict) -> dict:
    keep = {k: v for k, v in case.items() if k in ("hf", "preset", "mode", "optimizer", "overrides")}
    # torch.optim.Muon refuses 3-D tensors, and training needs the Session's step: ours in one
    # process there (equal to torch's bit for bit: test_muon_in_one_process_equals_torch_muon...).
    if keep.get("preset") == "moe-nano" or keep.get("mode") == "train":
        return muon_run(0, 1, **keep)
    return muon_run(0, 1, reference=True, **keep)


def _merged(ranks: list[list[dict]], i: int) -> dict:
    out: dict = {}
    for r in ranks:  # a pipeline rank holds its stage's parameters only
        out.update(r[i]["params"])
    return out


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_muon_under_sharding_equals_one_process(world, cases):
    ranks = run_distributed(muon_cases, world, cases=list(cases.values()), timeout_s=600)
    for i, (name, case) in enumerate(cases.items()):
        ref, got = _reference(case), _merged(ranks, i)
        assert set(got) == set(ref["params"]), name
        diff = max((got[k] - ref["params"][k]).abs().max().item() for k in got)
        if case.get("mode") == "train":
            assert diff <= TRAIN_PARAM_TOL, (name, diff)
            loss_diff = max(abs(a - b) for a, b in zip(ranks[0][i]["losses"], ref["losses"]))
            assert loss_diff <= TRAIN_LOSS_TOL, (name, loss_diff)
        else:
            assert diff == 0.0, (name, diff)


# --------------------------------------------------------------------------- planner vs ledger
PLAN_CASES = [dict(strategy=s, optimizer=o) for s in ("ddp", "fsdp") for o in OPTIMIZER_NAMES] + [
    dict(strategy="zero1", optimizer="muon"), dict(strategy="fsdp", optimizer="muon", preset="moe-nano", ep=2)]


def test_planner_optimizer_bytes_equal_the_ledgers():
    """The planner's optimizer-state bytes per rank equal the measured ones within 1% (the goal)."""
    ranks = run_distributed(optimizer_bytes_vs_plan, 2, cases=PLAN_CASES, timeout_s=300)
    for rank, results in enumerate(ranks):
        for case, (measured, predicted) in zip(PLAN_CASES, results):
            assert abs(predicted - measured) <= 0.01 * measured, (case, rank, measured, predicted)


def test_adafactor_shards_and_is_refused_only_where_its_state_is_off_the_device():
    from shardwise.core.config import ParallelConfig
    from shardwise.core.layout import resolve_layout
    from shardwise.optim.build import check_optimizer

    for strategy in ("ddp", "zero2", "fsdp", "hsdp"):
        check_optimizer(OptimizerConfig(name="adafactor"), resolve_layout(ParallelConfig(strategy=strategy), 4))
    with pytest.raises(ConfigError, match="adafactor.*host"):
        check_optimizer(OptimizerConfig(name="adafactor"), resolve_layout(ParallelConfig(strategy="fsdp-offload"), 2))
    with pytest.raises(ConfigError, match="muon.*host"):
        check_optimizer(OptimizerConfig(name="muon"), resolve_layout(ParallelConfig(strategy="fsdp-offload"), 2))


def test_muon_state_saved_under_fsdp_loads_in_one_process(tmp_path):
    """Muon's momentum reshards through DCP like AdamW's: saved by 2 fsdp ranks, loaded by one."""
    saved = run_distributed(muon_save_or_load, 2, strategy="fsdp", ckpt_dir=str(tmp_path), timeout_s=300)[0]
    loaded = muon_save_or_load(0, 1, strategy="single", ckpt_dir=str(tmp_path), load=True)
    assert saved and set(saved) == set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_the_planner_recommends_adafactor_where_adamw_fits_nowhere_on_the_device():
    """llama-3-8b on one H100: AdamW's state fits only offloaded to host memory (1% MFU); with no
    --optimizer the plan is Adafactor's on the device, says why, and its command trains Adafactor.
    Named optimizers are kept, and their commands name them."""
    import argparse

    from shardwise.plan import cli as plan_cli

    def plan(*argv: str):
        parser = argparse.ArgumentParser()
        plan_cli.register(parser.add_subparsers())
        return plan_cli.build_plan(parser.parse_args(["plan", "--model", "llama-3-8b", "--gpu", "h100",
                                                      "--gpus-per-node", "1", "--seq", "2048", *argv]))

    auto = plan()
    assert auto.workload.optimizer == "adafactor" and not auto.recommended.layout.offload
    assert auto.warnings[0].startswith("AdamW does not fit on h100-sxm at any on-device layout")
    assert "--set optimizer.name=adafactor" in auto.commands[0]
    assert all(not c.layout.offload for c in auto.candidates)  # adafactor's state stays on the device
    adamw = plan("--optimizer", "adamw")
    assert adamw.workload.optimizer == "adamw" and adamw.recommended.layout.offload
    assert "optimizer.name" not in adamw.commands[0]
    muon = plan("--optimizer", "muon", "--gpus-per-node", "8")
    assert muon.workload.optimizer == "muon" and "--set optimizer.name=muon" in muon.commands[0]
