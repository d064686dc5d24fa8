"""DPO on several ranks trains the same model as one process (``verify``'s comparison and fp32
tolerances, derived in shardwise.verify: only summation order differs), with gradient accumulation:

* 2 ranks: fsdp with the frozen sharded reference copy; ddp with LoRA (reference = adapters off)
  on packed pairs; fsdp with the reference precomputed before training; zero2 (the copy sharded as
  the policy's parameters are); context parallel (cp=2: every rank scores a chunk of every answer,
  the answers' sums added over the cp ranks) with LoRA on packed pairs; a Qwen2-MoE under expert
  parallel (ep=2) with its router aux loss joining the DPO loss; pipeline parallel with LoRA (the
  reference through the pipeline's forward) and fsdp+pp with precomputed log-probs on packed pairs;
* 4 ranks: fsdp+tp (dp_shard 2 x tp 2: vocabulary-sharded logits under loss_parallel) with the
  frozen copy, and with LoRA; fsdp+tp+cp (tp 2 x cp 2); a Qwen3-MoE under cp 2 x ep 2; fsdp+tp+pp
  with LoRA; and the logged DPO metrics (window means and held-out evaluation) equal one process's
  on every rank, under fsdp+tp, dp 2 x cp 2 and dp 2 x pp 2: global, not rank 0's, each pair
  counted once.

Then a 2-rank ``shardwise train hf-dpo`` killed after step 3 and resumed continues bit-exactly
(every logged loss and DPO metric, and the final weights). What a pipeline cannot run (the frozen
copy, pairs cut apart, cp beside pp) is refused by name. CI time: about 3-4 minutes on 2 idle cores
(the 4-rank spawn is the longest)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shardwise.core.config import load_config  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from shardwise.verify import compare, reference_config, run_steps  # noqa: E402
from tests.helpers.ckpt import final_weights, run_cli  # noqa: E402
from tests.helpers.preference import (  # noqa: E402
    dpo_metrics,
    dpo_overrides,
    dpo_rank,
    preference_records,
    write_jsonl,
)
from tests.helpers.sft import save_qwen2, save_qwen2_moe, save_qwen3_moe, verify_cases  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    return tmp, save_qwen2(tmp / "qwen", seed=3), write_jsonl(tmp / "prefs.jsonl", preference_records(48, seed=5))


def _cfg(inputs, strategy, nproc, *extra, model=None):
    tmp, qwen, data = inputs
    return load_config("hf-dpo", [*dpo_overrides(model or qwen, data, strategy), f"parallel.nproc={nproc}",
                                  "train.grad_accum_steps=2", "train.lr=1e-3", *extra])


# A mixture of experts' router aux loss joins the DPO loss (transformers adds it when the config's
# output_router_logits is true, as TRL does); the attention projections carry the LoRA adapters.
AUX = "model.overrides.output_router_logits=true"
PP = ("parallel.pp=2", "parallel.pp_microbatches=2")


def _check(inputs, cases, nproc, metrics_cases=()):
    tmp = inputs[0]
    runs = [{"cfg": cfg, "steps": STEPS, "out": str(tmp / f"run-{name}")} for name, cfg in cases.items()]
    if not metrics_cases:
        ranks = [{"verify": r} for r in run_distributed(verify_cases, nproc, timeout_s=500, cases=runs)]
    else:
        metrics = [{"cfg": cfg, "steps": STEPS, "out": str(tmp / f"run-metrics-{i}")}
                   for i, cfg in enumerate(metrics_cases)]
        ranks = run_distributed(dpo_rank, nproc, timeout_s=500, cases=runs, metrics=metrics)
    for i, (name, cfg) in enumerate(cases.items()):
        got = ranks[0]["verify"][i]
        ref = run_steps(reference_config(cfg, got["dp_size"]), STEPS, tmp / f"ref-{name}")
        report = compare(ref, got, "fp32")
        assert report.passed, f"{name}:\n{report.table()}"
        # Policy == reference at step 1: log 2 (IPO: (1 / (2 beta))^2 = 1 at beta 0.5), plus the
        # routers' (positive) aux loss where it joins.
        first = 1.0 if "ipo" in name else 0.6931471805599453
        if "aux" in name:
            assert ref["losses"][0] > first + 1e-4, name
        else:
            assert abs(ref["losses"][0] - first) < 1e-6, name
        assert ref["losses"][-1] < ref["losses"][0], name  # it trained
    for i, cfg in enumerate(metrics_cases):
        # Global metrics: every rank reports one process's numbers (sums over all ranks' pairs).
        dp = ranks[0]["metrics"][i]["dp_size"]
        one = dpo_metrics(reference_config(cfg, dp), STEPS, str(tmp / f"ref-metrics-{i}"))
        one["dp_size"] = dp
        # 3 steps x 2 micro-batches x 2 pairs on each data-parallel rank
        assert one["dpo/pairs"] == STEPS * 2 * 2 * dp and one["val_pairs"] > 0
        for r in ranks:
            assert r["metrics"][i].keys() == one.keys()
            for key, value in one.items():
                assert r["metrics"][i][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_dpo_at_two_ranks_equals_one_process(inputs):
    moe = save_qwen2_moe(inputs[0] / "qwen-moe", seed=2)
    _check(inputs, {
        "fsdp-copy": _cfg(inputs, "fsdp", 2),
        "ddp-lora-packed": _cfg(inputs, "ddp", 2, "lora.rank=4", "data.pack=true", "train.lr=1e-2"),
        "fsdp-precomputed": _cfg(inputs, "fsdp", 2, "preference.precompute_reference=true"),
        "zero2-copy": _cfg(inputs, "zero2", 2),
        "fsdp-cp2-lora-packed": _cfg(inputs, "fsdp", 2, "parallel.cp=2", "lora.rank=4", "data.pack=true",
                                     "train.lr=1e-2"),
        "fsdp-ep2-moe-copy-aux": _cfg(inputs, "fsdp", 2, "parallel.ep=2", AUX, model=moe),
        # Pipeline parallel: pairs whole in each of the 2 microbatches; the live reference (adapters off)
        # runs the pipeline forward only, the precomputed one scored through it before training.
        "pp-lora": _cfg(inputs, "pp", 2, *PP, "lora.rank=4", "train.lr=1e-2"),
        "fsdp+pp-precomputed-packed": _cfg(inputs, "fsdp+pp", 2, *PP, "preference.precompute_reference=true",
                                           "data.pack=true"),
    }, 2)


def test_dpo_under_fsdp_tp_cp_ep_at_four_ranks_equals_one_process(inputs):
    moe = save_qwen3_moe(inputs[0] / "qwen3-moe", seed=2)
    _check(inputs, {
        "fsdp+tp-copy": _cfg(inputs, "fsdp+tp", 4, "parallel.tp=2"),
        "fsdp+tp-lora": _cfg(inputs, "fsdp+tp", 4, "parallel.tp=2", "lora.rank=4", "train.lr=1e-2"),
        "fsdp+tp+cp-copy-ipo": _cfg(inputs, "fsdp+tp", 4, "parallel.tp=2", "parallel.cp=2", "preference.loss=ipo"),
        "fsdp-cp2-ep2-moe-copy-aux": _cfg(inputs, "fsdp", 4, "parallel.cp=2", "parallel.ep=2", AUX, model=moe),
        # FSDP under a pipeline with a live reference and accumulation: its evaluation runs come first.
        "fsdp+tp+pp-lora": _cfg(inputs, "fsdp+tp+pp", 4, "parallel.tp=2", *PP, "lora.rank=4", "train.lr=1e-2"),
    }, 4, metrics_cases=[_cfg(inputs, "fsdp+tp", 4, "parallel.tp=2", "train.eval_batches=2"),
                         _cfg(inputs, "fsdp", 4, "parallel.cp=2", "train.eval_batches=2"),
                         # the training metrics come from the last stage's loss only
                         _cfg(inputs, "fsdp+pp", 4, *PP, "lora.rank=4", "train.eval_batches=2")])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dpo_kill_and_resume_is_bit_exact(inputs, cli_env):
    tmp, model, data = inputs
    args = ["train", "hf-dpo", "--nproc", "2", "--strategy", "fsdp"]
    for o in [*dpo_overrides(model, data, "fsdp"), "train.steps=5", "checkpoint.every=2", "train.log_every=1",
              "train.eval_every=5", "train.grad_accum_steps=2",
              # The kill at step 3 must find step 2's checkpoint published: a background write
              # (checkpoint.mode = auto) may still be going when the rank dies.
              "checkpoint.mode=sync"]:
        args += ["--set", o]
    ref_dir, run_dir = tmp / "resume-ref", tmp / "resume-run"
    # The reference and the run that gets killed after step 3 run side by side.
    ref = subprocess.Popen([sys.executable, "-m", "shardwise", *args, "--out", str(ref_dir)], env=cli_env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = run_cli([*args, "--out", str(run_dir), "--set", "debug.kill_rank=1", "--set", "debug.kill_at_step=3"],
                     cli_env)
    ref_out = ref.communicate(timeout=400)[0]
    assert ref.returncode == 0, ref_out
    assert killed.returncode != 0
    resumed = run_cli(["train", "--out", str(run_dir), "--resume", "--set", "debug.kill_rank=-1"], cli_env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    drop = ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "data_fraction")
    # Timings: the per-rank step phases and the checkpoint I/O figures differ from run to run.
    timing = ("phase/", "checkpoint_")
    kept = [[{k: v for k, v in r.items() if k not in drop and not k.startswith(timing)} for r in _metrics(d)]
            for d in (ref_dir, run_dir)]
    clean = [[r for r in rows if set(r) != {"step"}] for rows in kept]  # a checkpoint's I/O record alone
    assert clean[0] == clean[1]  # every loss, DPO metric and held-out metric, bitwise
    assert any("dpo/accuracy" in r for r in clean[0]) and any("val_accuracy" in r for r in clean[0])
    ref_w, run_w = final_weights(ref_dir), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], run_w[k]) for k in ref_w)


def test_what_pipeline_parallel_cannot_run_is_refused_by_name_before_launch(inputs):
    from shardwise.errors import ConfigError
    from shardwise.preflight import check_run

    with pytest.raises(ConfigError, match="not from a frozen copy of the model"):
        check_run(_cfg(inputs, "pp", 2, "train.micro_batch_size=4"), 2)
    # The micro-batch counts pairs: the layout's own rule keeps whole pairs in each microbatch.
    with pytest.raises(ConfigError, match="does not split into 4 equal pipeline microbatches"):
        check_run(_cfg(inputs, "pp", 2, "train.micro_batch_size=2", "lora.rank=4"), 2)
    with pytest.raises(ConfigError, match="context parallel beside pipeline parallel"):
        check_run(_cfg(inputs, "fsdp+pp", 4, "parallel.pp=2", "parallel.cp=2", "train.micro_batch_size=4",
                       "lora.rank=4"), 4)
