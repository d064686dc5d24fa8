"""The rehearsal: played ranks at world sizes 64 and 256 through the real Session on fake tensors,
their memory against the planner's prediction, and refusals that happen only at scale.

Each played rank is a process of its own (``rehearse.launch``); the cases below play one or two
ranks each on tiny models.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shardwise.core.config import ParallelConfig
from shardwise.core.layout import resolve_layout
from shardwise.errors import ConfigError
from shardwise.rehearse import cli, launch
from shardwise.rehearse.compare import BOUNDS, Row
from shardwise.rehearse.report import format_text

STATE = ("param_bytes", "grad_bytes", "optim_bytes")


def _args(recipe: str, *sets: str, strategy: str | None = None, nproc: int = 8, nnodes: int = 1,
          ranks: str = "0", steps: int = 2) -> argparse.Namespace:
    return argparse.Namespace(recipe=recipe, overrides=list(sets), strategy=strategy, nproc=nproc, nnodes=nnodes,
                              gpu="h100-sxm", ranks=ranks, device="cpu", steps=steps, jobs=2,
                              rank_timeout=600.0, json=True)


def test_parse_ranks_and_roles() -> None:
    assert launch.parse_ranks("0,7,60-63", 64) == [0, 7, 60, 61, 62, 63]
    with pytest.raises(ConfigError, match="outside this run's ranks 0..63"):
        launch.parse_ranks("64", 64)
    with pytest.raises(ConfigError, match="separated by commas"):
        launch.parse_ranks("first", 64)
    layout = resolve_layout(ParallelConfig(strategy="fsdp+tp+pp", tp=2, pp=4), 64, ranks_per_node=8)
    roles = launch.default_ranks(layout)
    assert roles[0] == 0 and roles[-1] == 63
    assert any(layout.coords(r)["pp"] == 3 for r in roles)  # the last stage is played
    # One of each role: a context-parallel rank holding the last chunk, a rank holding the last experts.
    layout = resolve_layout(ParallelConfig(strategy="fsdp+tp+pp", tp=2, pp=2, cp=2), 64, ranks_per_node=8)
    assert launch.default_ranks(layout) == [0, 2, 32, 63] and layout.cp_rank(2) == 1
    layout = resolve_layout(ParallelConfig(strategy="fsdp", ep=8), 64, ranks_per_node=8)
    assert launch.default_ranks(layout) == [0, 7, 63]  # rank 7: the last of 8 expert shards


def test_row_bounds() -> None:
    assert Row("param_bytes", 1000, 1019, BOUNDS["param_bytes"][1]).within
    assert not Row("param_bytes", 1000, 1021, BOUNDS["param_bytes"][1]).within
    assert Row("activation_bytes", 0, 0, 0.15).within and not Row("activation_bytes", 0, 1, 0.15).within
    # Negative transients (a one-micro-batch step's peak holds no gradient shard): judged on |plan|.
    assert Row("transient_bytes", -1000, -900, 0.15).within and Row("transient_bytes", -1000, -900, 0.15).diff_pct == 10
    assert not Row("transient_bytes", -1000, -800, 0.15).within


def _check_runs(report: dict) -> None:
    assert report["outcome"] == "runs", report["verdict"]
    for rank in report["ranks"]:
        by_col = {c["column"]: c for c in rank["comparison"]}
        # Model state is exact arithmetic over shapes in the planner: within 2% (the bound).
        for col in STATE:
            assert by_col[col]["within"], (rank["rank"], by_col[col])
        # (A ZeRO-1 rank that owns no parameter holds no optimizer state, and the plan says so.)
        assert by_col["param_bytes"]["measured"] > 0 and (by_col["optim_bytes"]["measured"] > 0
                                                          or by_col["optim_bytes"]["predicted"] == 0)
        assert any(c["dim"] != "?" for c in rank["collectives"]), rank["collectives"]
        # DCP's save plan for this rank (nothing written): its chunks of the parameters and optimizer
        # state, never more than it holds (FSDP's padding rows and non-persistent buffers are held but
        # not written: the last of 256 shards of a tiny model is nearly all padding).
        state = by_col["param_bytes"]["measured"] + by_col["optim_bytes"]["measured"]
        assert 0 < rank["save_plan"]["tensor_bytes"] <= state, (rank["save_plan"], state)
        # One step's ops priced on the target GPU: the roofline is a floor of a real step's compute.
        roof = rank["roofline"]
        assert roof["flops"] > 0 and roof["bytes"] > 0 and roof["roofline_s"] >= roof["flops"] / 989e12
    # The planner's step terms for the same command on the target GPU, printed beside the roofline.
    planned = report["planned_step"]
    assert planned["compute_s"] > 0 and planned["step_s"] >= planned["compute_s"], planned
    assert "the planner's step: compute " in format_text(report)
    assert report["verdict"].startswith(report["title"] + ": runs; rank ")


def test_the_report_sets_the_planners_compute_beside_a_measured_gpu_step() -> None:
    """On a real GPU (fake collectives) the played rank's step is compute only: the report gives the
    planner's compute term's difference to it (the H200 visit's 8B rank: 2.85 s planned, 3.08 measured)."""
    from shardwise.rehearse.report import _planned_compute

    planned = {"step_s": 2.9, "compute_s": 2.85, "comm_exposed_s": 0.05, "bubble_s": 0.0}
    rank = {"cuda": {"device_name": "NVIDIA H200"}, "step_s": [3.5, 3.083, 3.1]}
    line = _planned_compute(planned, {"roofline_s": 2.34}, rank)[0]
    assert "compute 2,850 ms (the roofline floor is 82% of it)" in line
    assert ("measured step on this GPU (the fastest, instrumented, fake collectives: compute only) 3,083 ms, "
            "the planner's compute 2,850 ms: -7.6%") in line
    # Played on another GPU than the target: the measured step is set beside the term priced there.
    here = dict(planned, here={"compute_s": 2.7, "gpu": "h200"})
    assert "the planner's compute priced on this h200 2,700 ms: -12.4%" in _planned_compute(here, {"roofline_s": 2.34},
                                                                                              rank)[0]
    assert "measured" not in _planned_compute(planned, {"roofline_s": 2.34}, {"step_s": [1.0]})[0]  # fake CPU times
    assert "not computed (no)" in _planned_compute({"refused": "no"}, {}, rank)[0]
    assert _planned_compute(None, {}, rank) == []


def _check_activations_and_peak(report: dict) -> None:
    for rank in report["ranks"]:
        for row in rank["comparison"]:
            if row["column"] in ("activation_bytes", "transient_bytes", "peak_bytes"):
                assert row["within"], (rank["rank"], row)


@pytest.mark.parametrize("case", [
    # fsdp at 256 ranks (32 nodes x 8), bf16 mixed precision: the first and the last shard.
    ("fsdp", 8, 32, "0,255", ("parallel.precision=\"bf16-mixed\"",)),
    # hsdp: 8 replicas of 8-way shards at 64 ranks, every block checkpointed (its backward recomputes it).
    ("hsdp", 8, 8, "63", ('parallel.activation_checkpointing="full"',)),
    # fsdp + tp at 256 ranks: 128-way shards of 2-way tensor-parallel layers, more shards than the tiny
    # model's row-parallel weights have rows per TP rank (FSDP pads each shard to whole rows; the plan
    # modelled every TP split on dim 0 and was 15-18 % high here until 2026-11-27); fp32 throughout.
    ("fsdp+tp", 8, 32, "0", ("parallel.tp=2", 'parallel.precision="fp32"')),
    # The run's own optimizer, not AdamW's state (the plan counts Adafactor's factored moments; its
    # relative step reads a norm on the host, which fake tensors answer with a placeholder).
    ("fsdp", 8, 1, "0", ("optimizer.name=\"adafactor\"",)),
    # Muon: its sharded Newton-Schulz plans come from mesh coordinates read on the host.
    ("fsdp+tp", 4, 2, "0", ("optimizer.name=\"muon\"", "parallel.tp=2")),
    # A mixture of experts with its 8 experts split 8 ways at 64 ranks (routed evenly: fake tensors
    # carry no routing), bf16 (transformers' grouped experts kernel). Each rank's one expert is
    # sharded over the 8 ranks holding it along dim 1 (ep.expert_shard_placement): the first and the
    # last rank's state as the plan's (plan.memory.fsdp_chunk), both exact.
    ("fsdp", 8, 8, "0,63", ("model.hf_config=\"qwen3-moe-tiny\"", "parallel.ep=8",
                            "parallel.precision=\"bf16-mixed\"")),
    # The same with each MoE layer recomputed alone (activation_checkpointing = "moe", which the plan
    # searches for MoE models): activations, transients and peak within the 15 % (measured
    # 2026-11-28: -6.1 / -3.5 / -5.3 %).
    ("fsdp", 8, 8, "0", ("model.hf_config=\"qwen3-moe-tiny\"", "parallel.ep=8",
                         "parallel.precision=\"bf16-mixed\"", 'parallel.activation_checkpointing="moe"')),
])
def test_rehearsal_at_scale(case: tuple) -> None:
    strategy, nproc, nnodes, ranks, sets = case
    report = cli.rehearse(_args("hf-llama-tiny", "train.micro_batch_size=4", "train.grad_accum_steps=2",
                                "train.grad_clip=1.0", *sets, strategy=strategy, nproc=nproc, nnodes=nnodes,
                                ranks=ranks))
    _check_runs(report)
    assert report["ranks"][0]["coords"]  # the played rank's place in the 64/256-rank mesh
    if not any(s.startswith(("optimizer.", "model.hf_config")) for s in sets) or \
            'parallel.activation_checkpointing="moe"' in sets:
        # AdamW on the dense Llama: activations, transients (one moment of the backward at a time,
        # plan.memory._peak_moment) and the peak within the 15 % of the plan.
        _check_activations_and_peak(report)
    world = nproc * nnodes
    assert report["prediction"]["ranks"][-1]["rank"] == world - 1
    if any("parallel.ep" in s for s in sets):  # the token dispatch ran: its all-to-alls were counted
        assert any(c["op"].startswith("all_to_all") for c in report["ranks"][0]["collectives"])


def test_the_expert_parallel_dispatch_is_planned() -> None:
    """Expert parallel keeps one compute-dtype copy of the routed token slots per MoE layer outside
    the selective-op policy (plan.memory.ep_dispatch_bytes): the played rank's activations were 33 %
    over the plan here, and about twice the plan for Qwen3-30B-A3B at scale, before it was counted."""
    report = cli.rehearse(_args("hf-shakespeare", "model.kind=\"hf\"", "model.hf_config=\"qwen3-moe-tiny\"",
                                "parallel.ep=2", "parallel.precision=\"bf16-mixed\"",
                                "parallel.activation_checkpointing=\"selective-op\"", "train.micro_batch_size=2",
                                strategy="fsdp"))
    _check_runs(report)
    _check_activations_and_peak(report)


@pytest.mark.parametrize("checkpointing", ["selective", "selective-op"])
def test_experts_run_whole_on_every_tensor_parallel_rank_in_the_plan(checkpointing: str) -> None:
    """shardwise runs a mixture of experts whole on every TP rank, on the SP-gathered sequence: its
    saved tensors are not split tp ways (Kernels.experts_whole_on_tp). Planned as split, this
    rank's activations were +47 % and its peak +19 % over the plan (an under-prediction: the
    direction that runs out of memory); Mixtral-8x7B tp 2 ep 8 pp 4 at 64 ranks: +72 % / +17 %.
    Under ``selective-op`` the policy keeps the whole router's output, the attention projection's
    reduce-scatter and the routers' probabilities the aux loss reads: +19.1 % before they were
    planned (tests/test_plan_mechanisms.py has the hand computation)."""
    report = cli.rehearse(_args("hf-shakespeare", "model.kind=\"hf\"", "model.hf_config=\"mixtral-tiny\"",
                                "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.precision=\"bf16-mixed\"",
                                f"parallel.activation_checkpointing=\"{checkpointing}\"", "train.micro_batch_size=2",
                                strategy="fsdp+tp"))
    _check_runs(report)
    _check_activations_and_peak(report)


def test_sequence_parallel_keeps_the_gathered_inputs_in_the_plan() -> None:
    """torch's tensor parallel saves the attention's and the MLP's all-gathered whole-sequence inputs
    under sequence parallel (Megatron's keeps the shard and gathers again: Kernels.sp_regather). Planned
    as shards, llama-3-8b tp 8 at seq 8192 without checkpointing kept 52 % more activations than the
    plan (112 MiB a layer); exact since. The dense tiny Llama without checkpointing, bf16: its
    activations +8.1 % over the plan before, inside the issue's 15 %, so this case holds them to the
    2 % it asks of model state (every saved tensor here is counted, none estimated)."""
    report = cli.rehearse(_args("hf-llama-tiny", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.precision=\"bf16-mixed\"", "train.micro_batch_size=4",
                                "model.overrides.block_size=256", strategy="fsdp+tp"))
    _check_runs(report)
    _check_activations_and_peak(report)
    row = next(r for r in report["ranks"][0]["comparison"] if r["column"] == "activation_bytes")
    assert abs(row["measured"] - row["predicted"]) <= 0.02 * row["predicted"], row


_SMALL = ("train.micro_batch_size=4", "train.grad_accum_steps=1", "train.grad_clip=1.0",
          "model.overrides.block_size=32")


@pytest.mark.parametrize("case", [
    # fsdp+tp+pp at 64 ranks (pp 2 x dp 16 x tp 2), 1F1B: the first stage and the first rank of the last.
    ("0,32", ("parallel.tp=2", "parallel.pp=2")),
    # Interleaved 1F1B, two stages per rank: rank 32 holds stages 1 (a middle one) and 3 (the last).
    ("32", ("parallel.tp=2", "parallel.pp=2", 'parallel.pp_schedule="interleaved-1f1b"',
            "parallel.pp_stages_per_rank=2", "model.overrides.num_hidden_layers=4")),
    # ZBV (zero bubble, V placement): rank 0 holds both ends (stages 0 and 3: their in-flight micro-batches
    # keep the token ids and the loss's tensors too), rank 32 stages 1 and 2 and the most deferred
    # weight passes (3); both hold a weight pass's gradients until FSDP's next post-backward.
    ("0,32", ("parallel.tp=2", "parallel.pp=2", 'parallel.pp_schedule="zbv"', "parallel.pp_stages_per_rank=2",
            "model.overrides.num_hidden_layers=4")),
    # The same under full checkpointing, rank 32 (the middle of the V): each weight pass shares one
    # recomputation (pp._recompute_once; torch alone ran one per parameter group and the tracker kept every
    # copy: +85 % peaks), a pending weight pass keeps its norms' output gradients. (Rank 0 reads its loss's
    # log-softmax among the activations where the plan has it in the transients.)
    ("32", ("parallel.tp=2", "parallel.pp=2", 'parallel.pp_schedule="zbv"', "parallel.pp_stages_per_rank=2",
            "model.overrides.num_hidden_layers=4", 'parallel.activation_checkpointing="full"')),
    # Context parallel (all-to-all) at 64 ranks: the rank holding the second chunk of each sequence.
    ("1", ("parallel.cp=2", 'parallel.cp_impl="alltoall"')),
])
def test_pipeline_and_context_parallel_rehearse(case: tuple) -> None:
    """The schedule's pre-step messages answered on the played rank (rehearse/fake_p2p.py), and
    transformers' mask decided as a real run decides it: each played rank against its own
    stage's prediction (the first and the last stage differ)."""
    ranks, sets = case
    strategy = "fsdp+tp+pp" if "parallel.pp=2" in sets else "fsdp"
    report = cli.rehearse(_args("hf-llama-tiny", *_SMALL, *sets, strategy=strategy, nnodes=8, ranks=ranks))
    _check_runs(report)
    predicted = {r["rank"]: r for r in report["prediction"]["ranks"]}
    for rank in report["ranks"]:
        dims = {c["dim"] for c in rank["collectives"]}
        if "parallel.pp=2" in sets:
            assert rank["coords"]["pp"] == rank["rank"] // 32 and "pp" in dims
            # Read per micro-batch on a pipeline rank, as the planner counts them (measure.MemoryProbe);
            # the transients hold the schedule's other micro-batches in flight, torch's receive buffers,
            # the unsharded stage and the backward's working set (plan/memory.py): the 15 %.
            _check_activations_and_peak({"ranks": [rank]})
        else:
            assert any(c["op"].startswith("all") and c["dim"] == "cp" for c in rank["collectives"]), dims
    if ranks == "0,32":  # each stage against its own figures: stage 0 holds the embedding, the last the head
        first, last = (predicted[r] for r in (0, 32))
        assert first["activation_bytes"] != last["activation_bytes"]
    if "parallel.pp=2" in sets:
        # The messages the step time charges each pipeline rank (core.pp_schedules.p2p_messages_per_step),
        # counted by the rehearsal: one boundary tensor per micro-batch for each stage boundary the rank
        # holds that joins the other rank, each way. 1F1B's stage sends activations one way and gradients
        # the other (one boundary); interleaved rank 32's stages 1 and 3 cross three; each ZBV rank two,
        # the turn of its V (stages 1 and 2) staying on rank 32. The plan charged one boundary to every
        # rank before 2026-11-28.
        message, m = report["prediction"]["pp_message_bytes"], report["prediction"]["micro_batches"]
        boundaries = {"1f1b": 1, "interleaved-1f1b": 3, "zbv": 2}
        schedule = next((k for k in boundaries if f'pp_schedule="{k}"' in " ".join(sets)), "1f1b")
        for rank in report["ranks"]:
            planned = report["prediction"]["pp_messages"][rank["coords"]["pp"]]
            counted = {c["op"]: (c["count"], c["bytes"]) for c in rank["collectives"] if c["dim"] == "pp"}
            assert planned == boundaries[schedule] * m and message > 0, (rank["rank"], planned, m)
            assert counted.get("send") == counted.get("recv_") == (planned, planned * message), (rank["rank"], counted)


def test_scale_only_defect_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A rule only a run above 8 ranks meets: the rehearsal at 64 ranks refuses with its message."""
    config = tmp_path / "run.toml"
    config.write_text('name = "defect"\n[model]\nkind = "custom"\n'
                      'factory = "tests.helpers.models:build_mlp_refusing_at_scale"\n'
                      '[data]\nkind = "custom"\nfactory = "tests.helpers.models:build_blobs"\n'
                      '[train]\nmicro_batch_size = 4\n', encoding="utf-8")
    args = _args(str(config), strategy="fsdp", nnodes=8)
    args.json = False
    assert cli.cmd_rehearse(args) == 2
    out = capsys.readouterr().out
    assert "refused on rank 0: planted defect: this model refuses world size 64 (> 8)." in out


def test_rehearsal_of_a_pretrained_folder(tmp_path: Path) -> None:
    """A pretrained folder's config.json is the architecture; its weights are never read (fake tensors)."""
    from tests.helpers.hf import save_tiny

    folder = save_tiny(tmp_path / "llama")
    report = cli.rehearse(_args("hf-shakespeare", f'model.pretrained="{folder}"', 'model.hf_config=""',
                                "model.overrides.block_size=16", "train.micro_batch_size=4",
                                strategy="fsdp", nnodes=8))
    _check_runs(report)


def test_plan_rehearse_plays_the_top_recommendation(capsys: pytest.CaptureFixture) -> None:
    """``plan --rehearse``: the recommendation, run as its printed command would run it, at 64 ranks."""
    from shardwise.cli import main

    code = main(["plan", "--hf-config", "llama-tiny", "--gpus-per-node", "8", "--nodes", "8", "--seq", "128",
                 "--pp", "1", "--cp", "1", "--rehearse", "1"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0
    table = out[out.index("rehearsed (fake tensors"):]
    assert " runs\n" in table and "on 8x8 h100-sxm" in table, table
    # Each played rank's progress is relayed as it comes (a big rank takes minutes), the last step too.
    assert "rehearse: rank 0: prepared in " in captured.err, captured.err
    assert "rehearse: rank 0: step 3 of 3 in " in captured.err, captured.err


@pytest.mark.parametrize(("flags", "message"), [
    ({"device": "cuda"}, "--device cuda plays a rank on this machine's GPU"),
    ({"gpu": "nope"}, "unknown GPU kind 'nope'"),
    ({"strategy": "zero3-offload"}, "runs DeepSpeed's engine"),
])
def test_bad_rehearsals_are_refused_before_any_rank_starts(flags: dict, message: str) -> None:
    import torch

    if flags.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is allowed here")
    args = _args("gpt-shakespeare", strategy=flags.get("strategy"), nnodes=1)
    for key in ("device", "gpu"):
        if key in flags:
            setattr(args, key, flags[key])
    with pytest.raises(ConfigError, match=message) as e:
        cli.rehearse(args)
    assert "\n" not in str(e.value)


_PROPAGATION_CASE = '''
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from shardwise.rehearse.measure import MemoryProbe

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
mesh = init_device_mesh("cpu", (64,))
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
mode = FakeTensorMode(allow_non_fake_inputs=True)
with mode:
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    probe = MemoryProbe(model, opt)
    with probe.tracker:
        for _ in range(2):
            model(torch.randn(1, 512)).sum().backward()
            probe.end_micro_batch()
            opt.step()
            opt.zero_grad()
    out = probe.result()
print(json.dumps({"peak": out["peak"], "after_step": out["after_step"]}))
dist.destroy_process_group()
'''


def test_the_tracker_leaves_out_dtensor_shape_propagation() -> None:
    """DTensor's sharding propagation builds an op's arguments at their GLOBAL shape (fake tensors
    that hold no memory): a fused AdamW step over 64-way sharded parameters made torch's MemTracker
    count four global copies of every parameter inside the step (8 MiB here; 173.5 GiB against 49.9
    GiB max_memory_allocated in the first CUDA rehearsal of llama-3-8b). The optimizer state the
    tracker sees at any moment is at most the state it holds after the step (fused AdamW makes no
    temporaries), and the peak is far below the global parameters' four copies."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PROPAGATION_CASE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    state = out["after_step"]["optim_bytes"]
    # both moments of both local shards, fp32, and each parameter's step counter
    assert 0 <= state - 2 * 2 * 512 * 512 * 4 // 64 <= 64, out
    assert out["peak"].get("optim_bytes", 0) <= state, out
    assert out["peak"]["peak_bytes"] < 4 * 2 * 512 * 512 * 4, out  # below four global copies


def test_a_played_rank_past_its_time_limit_is_killed_and_named() -> None:
    # The rank is forked from the launcher's server (rehearse/launch.py); the limit kills it there
    # and names it, and the next rank still plays (the server stays usable).
    args = _args("hf-llama-tiny", *_SMALL, strategy="fsdp", ranks="0,1")
    args.rank_timeout, args.jobs = 0.3, 1
    report = cli.rehearse(args)
    assert [r.get("failed") for r in report["ranks"]] == [f"played rank {r} ran past 0 s" for r in (0, 1)]
    assert "the rehearsal failed on rank 0 (played rank 0 ran past 0 s)" in report["verdict"]


def test_the_op_counter_counts_local_flops_and_bytes_and_the_report_prices_them() -> None:
    """A matmul and an add on fake tensors, counted by hand: FLOPs by torch's formula (2mnk), bytes
    read and written; priced at the roofline, each op the slower of compute and memory."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardwise.rehearse.report import roofline_s
    from shardwise.rehearse.roofline import OpCounter

    counter = OpCounter()
    with FakeTensorMode(), counter:
        x, w = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(32, 128, dtype=torch.bfloat16)
        y = x @ w
        _ = y + y.float()  # a float32 elementwise op: bytes, no FLOP formula
    result = counter.result()
    mm = ["16-bit", 2 * 64 * 32 * 128, (64 * 32 + 32 * 128 + 64 * 128) * 2, 1]
    assert mm in result["ops"]
    assert result["flops"] == mm[1]
    peak = {"16-bit": 1e12, "fp32": 1e11}
    fast_memory = roofline_s([mm], peak_flops=peak, bytes_per_s=1e15)
    assert fast_memory == pytest.approx(mm[1] / 1e12)  # compute-bound
    assert roofline_s([mm], peak_flops=peak, bytes_per_s=1e6) == pytest.approx(mm[2] / 1e6)  # memory-bound
    assert roofline_s([[*mm[:3], 3]], peak_flops=peak, bytes_per_s=1e15) == pytest.approx(3 * fast_memory)


def test_the_op_counter_survives_a_flop_formula_that_refuses_grouped_query_attention(monkeypatch) -> None:
    """torch 2.11's SDPA FLOP formulas assert equal query and key/value heads (seen on the first GPU
    run of a 70B rank: the rehearsal died in the counter). With such a formula, GQA is counted as the
    kernel runs it (key/value broadcast to the query's heads); a formula that refuses anyway leaves
    the op counted by its bytes and named, and the step goes on."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import flop_counter

    from shardwise.rehearse import roofline

    def strict(query_shape, key_shape, value_shape):  # torch < 2.13
        assert query_shape[1] == key_shape[1] == value_shape[1], "sdpa_flop_count: shapes are incompatible"
        b, h, s, d = query_shape
        return 2 * 2 * b * h * s * key_shape[2] * d

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", strict)
    b, h, kv, s, d = 1, 8, 2, 16, 8

    def run() -> dict:
        counter = roofline.OpCounter()
        with FakeTensorMode(), counter:
            q = torch.empty(b, h, s, d, dtype=torch.bfloat16)
            k, v = torch.empty(b, kv, s, d, dtype=torch.bfloat16), torch.empty(b, kv, s, d, dtype=torch.bfloat16)
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return counter.result()

    result = run()
    # (the CPU runs its own flash kernel here, counted with the GPU kernels' formula)
    assert result["flops"] == 4 * b * h * s * s * d and not result["uncounted"]

    def refuses(*args, **kwargs):
        raise AssertionError("no")
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", refuses)
    result = run()
    assert result["flops"] == 0 and result["bytes"] > 0
    assert sum(result["uncounted"].values()) == 1 and "scaled_dot_product" in next(iter(result["uncounted"]))


def _tracked_run(tracker_class: type) -> tuple:
    """Three steps of a tiny model with a module called twice per forward (its fqn's second entry)
    and a checkpointed block, under ``tracker_class``: every module's peaks and peak snapshots,
    and the tracker's own."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.norm = nn.LayerNorm(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.blocks[0], x, use_reentrant=False)
            for block in self.blocks[1:]:
                x = self.norm(block(x))  # norm entered once per block
            return x

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = tracker_class()
    tracker.track_external(model, opt)
    rows = []
    with tracker:
        for _ in range(3):
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rows.append(sorted((s.mod_fqn, s.local_peak, s.snapshots) for s in tracker.memory_tracking.values()))
            tracker.reset_mod_stats()
    return rows, tracker.get_tracker_snapshot("peak")


def test_the_trackers_running_module_peaks_are_torchs() -> None:
    """``_LocalMemTracker._update_peak_stats`` visits the running modules only (torch's visits every
    module it ever tracked, on every op: most of a played 70B rank's time); the per-module peaks,
    their snapshots and the tracker's peak are torch's, on a model with a module entered several
    times per forward, a checkpointed block and the statistics reset between steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardwise.rehearse.measure import _LocalMemTracker

    class TorchPeaks(_LocalMemTracker):
        _update_peak_stats = MemTracker._update_peak_stats

    class NoModulePeaks(_LocalMemTracker):  # modules never indexed: no per-module peak is updated
        def _pre_fw_hook(self, module, inputs) -> None:  # noqa: ANN001 - torch's hook signature
            MemTracker._pre_fw_hook(self, module, inputs)  # the index is never filled

    ours, theirs = _tracked_run(_LocalMemTracker), _tracked_run(TorchPeaks)
    assert ours == theirs
    assert [fqn for fqn, _, _ in ours[0][0]] == ["Net", "Net.blocks.0", "Net.blocks.0.down", "Net.blocks.0.up",
                                                 "Net.blocks.1", "Net.blocks.1.down", "Net.blocks.1.up",
                                                 "Net.blocks.2", "Net.blocks.2.down", "Net.blocks.2.up", "Net.norm"]
    assert _tracked_run(NoModulePeaks)[0] != ours  # the comparison sees the per-module peaks


def test_a_rank_draws_its_steps_over_several_passes_of_the_data() -> None:
    """A big job's steps can outnumber the built-in text's samples per rank (Mixtral's batch of
    256 x 4,096 tokens on 64 ranks ended in a bare StopIteration): the played rank takes more
    passes, as the trainer's epochs do; data that gives a rank no batch at all is refused by name."""
    from shardwise.errors import ShardwiseError
    from shardwise.rehearse.worker import _draw

    assert _draw(lambda: iter([1, 2]), 5) == [1, 2, 1, 2, 1]
    with pytest.raises(ShardwiseError, match="fewer samples than one micro-batch per data-parallel rank"):
        _draw(lambda: iter([]), 3)


@pytest.mark.parametrize("case", [
    # DDP at 64 ranks, 2 accumulation steps: the first micro-batch under no_sync (no all-reduce),
    # the second all-reduces its bucket (the tiny model's gradients fit DDP's 1 MiB first bucket).
    ("ddp", "0", ("train.grad_accum_steps=2",)),
    # ZeRO-1 at 64 ranks: DDP's all-reduce, and ZeroRedundancyOptimizer's moments for the few whole
    # parameters rank 0 owns, broadcast to the others after its step; rank 63 owns none (its save
    # plan failed in torch until 2026-11-28: runtime/checkpoint/state.py).
    ("zero1", "0,63", ("train.grad_accum_steps=2",)),
    # DDP per pipeline stage (pp 2 x dp 32): find_unused_parameters (composed.py), so the bucket and
    # the used-parameter map are all-reduced, and torch's schedule arms the reducer itself.
    ("ddp+pp", "0,32", ("parallel.pp=2",)),
])
def test_ddp_layouts_rehearse(case: tuple) -> None:
    """DDP's C++ reducer is replaced by the rehearsal's stand-in (rehearse/fake_ddp.py): its buckets
    held as the transients the plan counts ("ddp buckets"), one all-reduce a bucket counted on dp."""
    strategy, ranks, sets = case
    report = cli.rehearse(_args("hf-llama-tiny", *_SMALL, *sets, strategy=strategy, nnodes=8, ranks=ranks))
    _check_runs(report)
    _check_activations_and_peak(report)
    assert any("DDP's C++ reducer is replaced by the rehearsal's stand-in" in n for n in report["notes"])
    for rank in report["ranks"]:
        by_col = {c["column"]: c for c in rank["comparison"]}
        grads = by_col["grad_bytes"]["predicted"]
        reduced = [c for c in rank["collectives"] if c["op"] == "allreduce_" and c["dim"] == "dp"]
        assert len(reduced) == 1, rank["collectives"]
        if strategy == "ddp+pp":  # the bucket and the int32 used map of the stage's parameter tensors
            assert reduced[0]["count"] == 2 and 0 < reduced[0]["bytes"] - grads <= 4 * 64, reduced
        else:  # one bucket, the whole model's gradients in their dtype, once a step
            assert reduced[0]["count"] == 1 and reduced[0]["bytes"] == grads, reduced
        if strategy == "zero1":  # the updated parameters broadcast from their owners (and DDP's buffers)
            sent = sum(c["bytes"] for c in rank["collectives"] if c["op"] == "broadcast_" and c["dim"] == "dp")
            assert sent >= by_col["param_bytes"]["predicted"], rank["collectives"]
            if rank["rank"] == 0:
                assert 0 < by_col["optim_bytes"]["measured"] < by_col["param_bytes"]["measured"]
            else:  # owns no parameter: no state, planned as such, and its (empty) share of the save plan
                assert by_col["optim_bytes"]["measured"] == by_col["optim_bytes"]["predicted"] == 0
                assert rank["save_plan"]["tensor_items"] > 0


_STAND_IN_CASE = '''
import copy, json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.tensor.debug import CommDebugMode
from shardwise.rehearse import fake_ddp

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
base = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
batches = [torch.randn(8, 512) for _ in range(6)]
out = {}
for name, unused in (("ddp", False), ("ddp_unused", True)):
    for kind in ("torch", "stand-in"):
        model = copy.deepcopy(base)
        with fake_ddp.standing_in() if kind == "stand-in" else torch.enable_grad():
            ddp = DDP(model, find_unused_parameters=unused)
        counts, sizes = [], []
        for i in range(3):  # steps of two micro-batches, the first under no_sync
            for m in range(2):
                with ddp.no_sync() if m == 0 else torch.enable_grad(), CommDebugMode() as comm:
                    ddp(batches[2 * i + m]).square().mean().backward()
                counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
            if kind == "torch":
                data = ddp._get_ddp_logging_data()
                sizes.append(str(data.get("rebuilt_bucket_sizes") or data["bucket_sizes"]))
            else:
                sizes.append(", ".join(str(b.buffer.numel() * 4) for b in ddp.reducer.buckets))
            grads = [p.grad.clone() for p in model.parameters()]
            for p in model.parameters():
                p.grad = None
        out[name + " " + kind] = {"counts": counts, "sizes": sizes, "grads": [g.sum().item() for g in grads]}
print(json.dumps(out))
'''


def test_the_ddp_stand_in_buckets_and_reduces_as_torchs_reducer() -> None:
    """The stand-in against torch's C++ reducer on real tensors (gloo, one rank): the same bucket
    sizes at every step (plain DDP: one bucket of everything, then the rebuild in gradient-ready
    order with the 1 MiB first bucket; find_unused_parameters: 1 MiB and 25 MiB buckets from the
    start, never rebuilt), the same collectives per micro-batch (none under no_sync, the rebuild's
    two broadcasts, one all-reduce a bucket, the used map), and the same gradients."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _STAND_IN_CASE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("ddp", "ddp_unused"):
        real, stand_in = out[f"{name} torch"], out[f"{name} stand-in"]
        assert stand_in["counts"] == real["counts"], name
        assert stand_in["sizes"] == real["sizes"], name
        assert stand_in["grads"] == pytest.approx(real["grads"], rel=1e-5), name
    assert out["ddp torch"]["sizes"][0] != out["ddp torch"]["sizes"][1]  # the rebuild is seen


def test_a_gpu_ranks_step_is_the_one_timed_alone() -> None:
    """On a GPU the tracked and counted steps carry their instruments' per-op work (a 70B rank's
    counted step read 16.3 s against 9.6 s alone): the report sets the step timed alone beside the
    planner's compute, not the fastest one (a result without it, above, falls back to the fastest)."""
    from shardwise.rehearse.report import _planned_compute

    planned = {"compute_s": 9.441, "comm_exposed_s": 0.98, "bubble_s": 0.0}
    rank = {"cuda": {"device_name": "GPU"}, "step_s": [36.9, 34.7, 17.7, 9.61], "timed_step_s": 9.61}
    (line,) = _planned_compute(planned, {"roofline_s": 6.5}, rank)
    assert "measured step on this GPU (uninstrumented, fake collectives: compute only) 9,610 ms" in line
    assert "the planner's compute 9,441 ms: -1.8%" in line
    rank["timed_step_s"] = 9.9  # slower than a counted step would be: still the one reported
    assert "9,900 ms" in _planned_compute(planned, {"roofline_s": 6.5}, rank)[0]


def test_a_gpu_rehearsal_prices_the_planners_compute_on_the_gpu_it_ran_on(monkeypatch) -> None:
    """``--device cuda`` on an H200 with the default target h100-sxm: the target's plan stays the
    verdict's, and the measured step is set beside the planner's term priced on the local GPU."""
    import torch

    monkeypatch.setattr(launch, "check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(launch, "play", lambda *a, **k: [{"rank": 0, "failed": "not played here"}])
    args = _args("hf-shakespeare", "model.kind=hf", "model.hf_config=llama-tiny", strategy="fsdp", nproc=2)
    args.device = "cuda"
    planned = cli.rehearse(args)["planned_step"]
    assert planned["here"]["gpu"] == "h200" and planned["here"]["compute_s"] > 0, planned
    assert planned["compute_s"] > 0  # the target's own, for the report's first line
