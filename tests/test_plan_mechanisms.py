"""The planner's mechanisms, each against a hand computation or the rule it states.

* Expert parallel under a pipeline: the all-to-all of one step is charged for the MoE layers of the
  busiest stage only (halving with each doubling of pp), again for the recomputed forward, and
  hidden only where the stack overlaps it; the unsharded-stage memory holds n_experts / ep experts.
* MoE with context parallel: planned (refused by name for a family CP does not run); ep over tp or pp
  ranks: refused by name.
* The offload fallback's compute: its own layout's, positive, never another candidate's.
* The ranking rule (search.tier): speed among usable layouts; offload only as the only way or
  within OFFLOAD_FACTOR.
* A pipeline's point-to-point term per schedule: every stage boundary the busiest rank holds that joins
  another rank, once per micro-batch; exposed: the transfers the schedule waits on (all under 1F1B and
  GPipe, the fill and drain's where torch posts receives early, DualPipeV's gradients) and what the
  links carry beyond the compute.
* A pipeline's compute at its busiest rank's pace: the rank holding the last stage also runs the
  output head, so an even split of the blocks leaves it behind; ``pp_first_stage_fewer`` evens it.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.plan.advice import GIB, Cluster, Workload, evaluate, predict_step_time
from shardwise.plan.cost import CALIBRATIONS, Fabric, moe_layers_on_busiest_stage, pipeline_p2p_s
from shardwise.plan.memory import PRECISIONS, REDUCE_BYTES, Kernels, Layout, memory_breakdown
from shardwise.plan.offload import offload_advice, offload_compute
from shardwise.plan.presets import gpu, model_preset
from shardwise.plan.search import OFFLOAD_FACTOR, TIGHT_HEADROOM_GIB, make_plan, rank_key, tier

H100 = CALIBRATIONS["h100"]
BF16 = PRECISIONS["bf16"]


@pytest.fixture(scope="module")
def mixtral():
    return model_preset("mixtral-8x7b")


def _exposed(spec, cluster, work, layout):
    return predict_step_time(spec, cluster, work, layout, H100)


def test_ep_all_to_all_per_stage_against_a_hand_computation(mixtral):
    """Mixtral (32 MoE layers, top-2, hidden 4096) on 4 nodes of 8 H100, seq 4096, micro-batch 1,
    8 micro-batches, no checkpointing: per MoE layer and micro-batch 4 all-to-alls of
    (ep-1)/ep x 4096 x 2 x 4096 x 2 bytes at the ep group's bus bandwidth, plus (ep-1) hop latencies;
    times the busiest stage's MoE layers (32 / pp) and the 8 micro-batches."""
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=4)
    work = Workload(seq=4096, micro_batch=1, grad_accum=8, checkpoint="none")
    fabric = cluster.fabric("bf16", H100)
    ep = 8
    gbs = fabric.collective_gbs(ep, 1)
    per_call = (ep - 1) / ep * 4096 * 2 * 4096 * 2 / (gbs * 1e9) + (ep - 1) * H100.hop_latency_s
    seen = {}
    for pp in (2, 4):
        layout = Layout("fsdp+pp", dp=32 // pp, pp=pp, ep=ep)
        assert moe_layers_on_busiest_stage(mixtral, layout) == 32 // pp
        hand = 8 * 4 * (32 // pp) * per_call
        with_ep = _exposed(mixtral, cluster, work, layout)
        without = _exposed(mixtral, cluster, work, dataclasses.replace(layout, ep=1))
        # Nothing else in the step depends on ep: the difference is the all-to-all alone.
        assert with_ep.comm_exposed_s - without.comm_exposed_s == pytest.approx(hand, rel=1e-9)
        seen[pp] = hand
    assert seen[4] == pytest.approx(seen[2] / 2)  # each doubling of pp halves a rank's share
    # Full recompute runs every forward again: its dispatch and combine too (4 + 2 calls per layer).
    full = dataclasses.replace(work, checkpoint="full")
    layout = Layout("fsdp+pp", dp=8, pp=4, ep=ep)
    extra = (_exposed(mixtral, cluster, full, layout).comm_exposed_s
             - _exposed(mixtral, cluster, full, dataclasses.replace(layout, ep=1)).comm_exposed_s)
    assert extra == pytest.approx(8 * 6 * 8 * per_call, rel=1e-9)
    # A stack that overlaps the all-to-all with another micro-batch's compute hides it up to that compute.
    overlap = dataclasses.replace(work, kernels=Kernels(ep_overlap=True))
    hidden = _exposed(mixtral, cluster, overlap, layout)
    assert hidden.comm_exposed_s == pytest.approx(_exposed(mixtral, cluster, overlap,
                                                           dataclasses.replace(layout, ep=1)).comm_exposed_s)
    assert hidden.comm_total_s > hidden.comm_exposed_s


@pytest.mark.parametrize(("schedule", "pp", "v", "busiest", "waited"), [
    # 1F1B and GPipe: an end rank holds one boundary, a middle one two; all waited on (pp 2: both ends).
    ("1f1b", 2, 1, 1, 8), ("1f1b", 4, 1, 2, 16), ("gpipe", 4, 1, 2, 16),
    # Loop placement, v stages per rank: a middle rank's 2v boundaries all join other ranks; the first
    # micro-batch's forward waits on the chain's p v - 1 transfers and the last one's backward again.
    ("interleaved-1f1b", 2, 2, 3, 6), ("interleaved-1f1b", 4, 2, 4, 14), ("interleaved-zb", 4, 3, 6, 22),
    # Looped BFS: the chain's later loops arrive while the rank still runs the earlier stage: 2 (p - 1).
    ("looped-bfs", 4, 2, 4, 6),
    # V placement: a middle rank's two stages have two remote neighbours each; the V's turn stays on
    # rank p - 1, so the chain has 2p - 2 remote boundaries. DualPipeV waits on every gradient.
    ("zbv", 2, 2, 2, 4), ("zbv", 4, 2, 4, 12), ("dualpipev", 4, 2, 4, 16),
])
def test_pipeline_p2p_per_schedule_against_a_hand_computation(schedule, pp, v, busiest, waited):
    """Llama-3 8B (hidden 4096), seq 4096, micro-batch 1, bf16, 8 micro-batches: each message is
    4096 x 4096 x 2 bytes at the pp group's bandwidth plus one hop latency; the busiest rank sends
    ``busiest`` of them per micro-batch (and receives as many), and the step waits on ``waited``.
    Before 2026-11-28 the planner charged 2 per micro-batch to every schedule, all exposed."""
    spec = model_preset("llama3-8b")
    fabric = Fabric(gpus_per_node=8, intra_gbs=300.0, nic_gbs=40.0, peak_tflops=989.0)
    # fsdp+pp: ddp+pp with two replicas is refused under the zero-bubble schedules (core.pp_schedules).
    layout = Layout("fsdp+pp", dp=2, shard=2, pp=pp, pp_schedule=schedule, pp_stages_per_rank=v, pp_microbatches=8)
    per_message = 4096 * 4096 * 2 / (fabric.collective_gbs(pp, 2) * 1e9) + H100.hop_latency_s

    def p2p(compute_s: float) -> tuple[float, float]:
        return pipeline_p2p_s(spec, layout, BF16, fabric, seq=4096, micro_batch=1, micro_batches=8,
                              compute_s=compute_s, alpha_s=H100.hop_latency_s)

    total, exposed = p2p(compute_s=10.0)  # far more compute than transfers
    assert total == pytest.approx(busiest * 8 * per_message, rel=1e-12)
    assert exposed == pytest.approx(waited * per_message, rel=1e-12)
    # Links busier than the step computes: the excess is waited on too, never more than the total.
    assert p2p(compute_s=0.0) == pytest.approx((total, total), rel=1e-12)


def test_ep_memory_per_stage_holds_its_own_experts(mixtral):
    """The unsharded-stage terms (params in bf16, grads in fp32) of a pp=4 stage: its 8 blocks hold
    8 x 8 experts of 3 x 4096 x 14336 elements; under ep 8 a rank keeps 1 of the 8 per layer."""
    prec = BF16
    expert = 3 * 4096 * 14336
    base = Layout("fsdp+pp", dp=8, pp=4)
    parts = {}
    for ep in (1, 8):
        m = memory_breakdown(mixtral, dataclasses.replace(base, ep=ep), prec, "adamw", seq=4096, micro_batch=1,
                             checkpoint="full", grad_accum=8)
        parts[ep] = (m.transient_parts["unsharded stage params (pp schedule)"],
                     m.transient_parts["unsharded stage grads (pp schedule)"])
    dropped = 8 * 8 * expert * 7 // 8  # the other 7 experts of each of the stage's 8 MoE layers
    assert parts[1][0] - parts[8][0] == prec.param * dropped
    assert parts[1][1] - parts[8][1] == REDUCE_BYTES * dropped


def test_ep_experts_fewer_than_their_shard_ranks_split_along_dim_1(mixtral):
    """Mixtral at ep 8 over 16 shard ranks: one expert a rank, sharded over the 2 ranks holding it.
    By rows FSDP would pad the one row to two (the first rank the whole expert, the second none);
    the runtime shards such experts along dim 1 (parallel/experts/ep.expert_shard_placement), so
    every rank holds half of each of its experts, by hand below."""
    import torch
    from torch.distributed.tensor import Shard

    from shardwise.parallel.experts.ep import expert_shard_placement
    from shardwise.plan.memory import fsdp_chunk
    from shardwise.plan.predict import predict_run

    layout = Layout("fsdp", dp=16, shard=16, ep=8)
    experts = [p for p in mixtral.params if ".experts." in p.name]
    assert experts
    for rank in (0, 1, 15):
        for p in experts:
            (padded, actual), shape = fsdp_chunk(mixtral, layout, p, rank)
            assert padded == actual == p.numel // 16 and shape[0] == 1, (rank, p.name, shape)
    ranks = predict_run(mixtral, layout, precision="bf16-mixed", seq=4096, micro_batch_size=1).ranks
    assert ranks[0].optim_bytes == pytest.approx(ranks[15].optim_bytes, rel=1e-3)
    # The runtime's rule on the local tensors it sees: 1 expert over 2 ranks by dim 1; 2 by rows.
    assert expert_shard_placement(torch.empty(1, 8, 4), shard_ranks=2) == Shard(1)
    assert expert_shard_placement(torch.empty(2, 8, 4), shard_ranks=2) is None


def test_moe_with_context_parallel_planned_and_ep_over_tp_pp_refused_by_name(mixtral):
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=2)
    # Mixtral's attention splits over cp (the runtime runs it, families.CP_FAMILIES): planned.
    plan = make_plan(mixtral, cluster, Workload(seq=8192, micro_batch=1, search=("checkpoint",)), cp=2)
    assert plan.candidates and all(c.layout.cp == 2 for c in plan.candidates)
    # A MoE family the runtime does not split over cp (Qwen2-MoE: untested there) is refused by name.
    qwen2_moe = dataclasses.replace(mixtral, family="qwen2_moe")
    plan = make_plan(qwen2_moe, cluster, Workload(seq=8192, micro_batch=1, search=("checkpoint",)), cp=2)
    assert not plan.candidates
    assert any(line.startswith("cp2: context parallel does not run the mixture-of-experts qwen2_moe") for line in
               plan.skipped), plan.skipped
    # No command for other degrees than those asked for (no offload row), and the warning says why.
    assert plan.recommended is None and not plan.commands and not plan.offload
    assert any("no layout runs with the degrees asked for" in w for w in plan.warnings)
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=4)
    plan = make_plan(mixtral, cluster, Workload(seq=4096, micro_batch=1, global_batch=64, checkpoint="full"),
                     tp=2, pp=4, ep=8)
    # ep 8 > dp_shard x cp = 4 would span tp and pp ranks: the layout refuses it, by name.
    assert any(line.startswith("fsdp+tp+pp(tp2,ep8,pp4): parallel.ep=8 must divide the ranks that FSDP shards "
                               "over, dp_shard x cp = 4") and "expert-tensor-parallel" in line
               for line in plan.skipped), plan.skipped


def test_offload_fallback_compute_is_its_own_layouts(mixtral):
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=1)
    work = Workload(seq=4096, micro_batch=2, global_batch=32, checkpoint="full", recipe="hf-shakespeare")
    compute, mb, accum = offload_compute(mixtral, cluster, work)
    # Full sharding over the 8 GPUs, 2 sequences each, 2 micro-batches for the 32-sequence batch.
    assert (mb, accum) == (2, 2)
    hand = predict_step_time(mixtral, cluster, dataclasses.replace(work, grad_accum=2, global_batch=None),
                             Layout("fsdp", dp=8)).compute_s
    assert compute == pytest.approx(hand) and compute > 0
    # The rows and the command take that compute and batch whatever candidates exist (none here).
    rows, commands, _ = offload_advice(mixtral, cluster, work, [])
    assert rows and all(r.step_s >= compute for r in rows)
    assert "train.micro_batch_size=2" in commands[0] and "train.grad_accum_steps=2" in commands[0]
    # Not below the GPUs' peak: model FLOPs of the step over the step time stay under 100 % MFU.
    flops = 6 * 12.9e9 * 4096 * 32 / 8
    assert flops / rows[0].step_s < gpu("h100-sxm").bf16_tflops * 1e12


def _with(cand, *, verdict_total_gib=None, speed=None, offload=None):
    """A copy of ``cand`` with its total memory / speed / offload flag replaced."""
    out = dataclasses.replace(cand)
    if verdict_total_gib is not None:
        out.memory = dataclasses.replace(cand.memory)
        out.memory.activations = int(cand.memory.activations + verdict_total_gib * GIB - cand.memory.total)
        out.fits = out.memory.total <= out.budget_bytes
    if speed is not None:
        t = cand.time
        out.time = dataclasses.replace(t, tokens_per_step=int(speed * t.step_s * t.world))
    if offload is not None:
        out.layout = Layout("fsdp-offload" if offload else "fsdp", dp=cand.layout.dp)
    return out


def test_ranking_rule():
    spec = model_preset("llama-3-8b")
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=1)
    base = evaluate(spec, cluster, Workload(seq=4096, micro_batch=1, checkpoint="full"), Layout("fsdp", dp=8))
    device = base.device_bytes / GIB
    fits = _with(base, verdict_total_gib=40, speed=1000)
    tight_room = _with(base, verdict_total_gib=device - TIGHT_HEADROOM_GIB - 0.5, speed=2000)
    tight_none = _with(base, verdict_total_gib=device - 0.5, speed=3000)
    assert (fits.verdict, tight_room.verdict, tight_none.verdict) == ("fits", "tight", "tight")
    order: dict[str, int] = {}
    # A tight layout that leaves the reserve free is ranked by speed with the fitting ones.
    ranked = sorted([fits, tight_room, tight_none], key=lambda c: rank_key(c, order, 3000))
    assert ranked == [tight_room, fits, tight_none]
    # Offload: 57x slower than the fastest on-GPU layout comes after every on-GPU one in the device...
    slow_offload = _with(base, verdict_total_gib=20, speed=2000 / 57, offload=True)
    assert tier(slow_offload, 2000) == 2 > tier(tight_none, 2000)
    # ... within OFFLOAD_FACTOR it competes on speed, and with no on-GPU layout it is the way.
    near = _with(base, verdict_total_gib=20, speed=2000 / OFFLOAD_FACTOR * 1.01, offload=True)
    assert tier(near, 2000) == 0 and tier(slow_offload, None) == 0
    # The qwen3-30b-a3b case: the plan recommends an on-GPU layout, not fsdp-offload at 117 tok/s.
    plan = make_plan(model_preset("qwen3-30b-a3b"), cluster,
                     Workload(seq=4096, search=("checkpoint", "micro_batch", "grad_sync")))
    assert plan.recommended is not None and not plan.recommended.layout.offload
    assert any(line.startswith("fsdp-offload: fits") and "more than 2x slower" in line for line in plan.rejected)


@pytest.mark.parametrize("model,nodes,precision", [("llama-3-8b", 2, None), ("qwen3-30b-a3b", 1, None),
                                                   ("gpt2", 2, None), ("qwen3-30b-a3b", 1, "bf16-true")])
def test_dry_run_columns_equal_plan_columns_for_every_strategy(model, nodes, precision):
    """``train --dry-run``'s per-rank prediction (plan/predict.py, what the run stores) and the
    plan's table agree on every column for every candidate, offload included: parameters (with any
    master copy), gradients, optimizer state, activations, transients, the peak without the
    allocator's fragmentation, and host-resident state in the host column, not the GPU's. Also under
    train's ``bf16-true`` (bfloat16 parameters, gradients and AdamW moments), which plan takes too."""
    from shardwise.plan import cli as plan_cli
    from shardwise.plan.advice import TRAIN_PRECISION, runtime_batch
    from shardwise.plan.predict import predict_run
    from tests.test_plan_grid import plan_args

    plan = plan_cli.build_plan(plan_args("--model", model, "--gpus-per-node", "8", "--nodes", str(nodes),
                                         "--seq", "2048" if model == "gpt2" else "4096",
                                         *(("--precision", precision) if precision else ())))
    if precision == "bf16-true":  # bfloat16 state: AdamW's two moments twice the parameters (+ fp32 steps)
        for c in plan.candidates:
            if not c.layout.offload and c.layout.sharding != "zero1":  # (ZeRO-1 shards only the state)
                assert 0 <= c.memory.optimizer - 2 * c.memory.params < 2**20 and c.memory.master == 0, c.name
        assert not plan.offload  # DeepSpeed's engines refuse bf16-true (plan/offload.py)
    strategies = set()
    for c in plan.candidates:
        w = plan.workload
        mb, accum = runtime_batch(c.layout, c.micro_batch, c.grad_accum)
        pred = predict_run(plan.spec, c.layout, precision=TRAIN_PRECISION[w.precision], seq=w.seq,
                           micro_batch_size=mb, grad_accum_steps=accum, activation_checkpointing=c.checkpoint,
                           ac_every=w.ac_every, grad_sync=c.grad_sync, ranks_per_node=plan.cluster.gpus_per_node,
                           loss_chunks="auto" if w.loss_chunks is None else w.loss_chunks)
        # The plan's state columns are its largest rank's (over stages and shards); its activations
        # and transients those of the pipeline rank that peaks higher of the first (most micro-batches
        # in flight) and the last (the head and the loss), each as that rank's --dry-run row says.
        m = c.memory
        big = max(pred.ranks, key=lambda q: (q.state_bytes + q.host_bytes, -q.rank))
        columns = {"params": (big.param_bytes, m.params + m.master), "grads": (big.grad_bytes, m.grads),
                   "optim": (big.optim_bytes, m.optimizer)}
        assert all(a == b for a, b in columns.values()), (c.name, columns)
        ends = [pred.ranks[0], pred.ranks[-1]]
        assert any((q.activation_bytes, q.transient_bytes) == (m.activations, m.transient) for q in ends), c.name
        # The plan's peak is the worst rank's: no rank's exceeds it, and without a pipeline it is it.
        assert max(q.peak_bytes for q in pred.ranks) <= m.allocated, c.name
        if c.layout.pp == 1:
            assert big.peak_bytes == m.allocated, c.name
        # Host memory per node: the plan counts its largest rank's state on every GPU of the node.
        assert big.host_bytes * plan.cluster.gpus_per_node == m.host_bytes, c.name
        if c.layout.offload:
            assert all(q.host_bytes > 0 and q.state_bytes == 0 for q in pred.ranks)
        strategies.add(c.layout.strategy)
    assert len(strategies) >= 4, strategies


def test_stack_names_its_properties_and_each_is_settable_alone():
    from shardwise.errors import ConfigError as Err
    from shardwise.plan import cli as plan_cli
    from shardwise.plan.stacks import STACKS, stack_settings
    from tests.test_plan_grid import plan_args

    kernels, sync = stack_settings("megatron")
    assert kernels == Kernels(**STACKS["megatron"]) and sync is None
    kernels, sync = stack_settings("megatron", ["tp_overlap=false", "grad_sync=microbatch"])
    assert kernels.tp_overlap == "none" and kernels.state == "master-copy" and sync == "microbatch"
    assert stack_settings("megatron")[0].tp_overlap == "full"  # true / false: the boolean it was
    assert stack_settings("shardwise", ["tp_overlap=backward"])[0].tp_overlap == "backward"
    assert stack_settings("torchtitan")[1] == "microbatch"
    for bad in (("nope", []), ("shardwise", ["tp_overlap=maybe"]), ("shardwise", ["colour=red"]),
                ("shardwise", ["state=bf16"])):
        with pytest.raises(Err):
            stack_settings(*bad)
    plan = plan_cli.build_plan(plan_args("--model", "llama-3-8b", "--stack", "torchtitan", "--stack-set",
                                         "loss=fused"))
    assert plan.workload.kernels.loss == "fused" and plan.workload.grad_sync == "microbatch"
    assert "grad_sync" not in plan.workload.search


def test_a_compiled_loss_is_planned_as_the_fused_kernel_it_becomes():
    """With ``train.compile`` on, the trainer compiles the loss (not under TP), and inductor fuses the
    up-cast, log-softmax and NLL: the whole logits cost their 16-bit copy and a log-sum-exp per token
    (2 V + 4 bytes a token), not the eager loss's fp32 log-softmax kept (4 V) and the two fp32
    gradients of its backward (8 V); its backward writes a new 16-bit gradient of the logits (2 V,
    inductor's generated code: tests/test_compile.py). Measured on an H200 (GPT-2 124M, 8 x 1024
    tokens, logits whole): 6.15 and 6.14 GiB peaks, against 9.35 planned as eager (with 6 V in its
    backward then) and 6.44 now. The same rule in ``plan`` (Workload.compile) and in ``--dry-run`` /
    the summary's prediction (predict_run)."""
    from shardwise.plan.predict import predict_run

    spec = model_preset("gpt2")
    tokens, v = 8 * 1024, spec.vocab
    args = dict(precision="bf16-mixed", seq=1024, micro_batch_size=8, loss_chunks="auto")
    eager, compiled = (predict_run(spec, Layout("single"), **args, compiled=c).ranks[0] for c in (False, True))
    assert eager.activation_bytes - compiled.activation_bytes == tokens * (4 * v - (2 * v + 4))
    assert eager.transient_bytes - compiled.transient_bytes == tokens * v * (2 * 4 - 2)
    # The planner's own candidates, with and without --compile, agree with the prediction.
    cluster = Cluster(gpu=gpu("h200"), gpus_per_node=1)
    work = Workload(seq=1024, micro_batch=8, grad_accum=1, loss_chunks=None)
    plan_eager, plan_compiled = (evaluate(spec, cluster, dataclasses.replace(work, compile=c), Layout("single"))
                                 for c in (False, True))
    assert plan_eager.memory.allocated - plan_compiled.memory.allocated == eager.peak_bytes - compiled.peak_bytes
    # Under tensor parallel the trainer leaves the loss eager: so does the plan.
    tp_args = dict(args, micro_batch_size=8)
    tp_layout = Layout("fsdp+tp", dp=1, tp=2)
    assert (predict_run(spec, tp_layout, **tp_args, compiled=True).ranks[0].activation_bytes
            == predict_run(spec, tp_layout, **tp_args, compiled=False).ranks[0].activation_bytes)


def test_cp_all_to_all_keeps_one_more_tensor_a_layer_and_repeated_kv_heads():
    """Under the all-to-all attention each block it does not recompute keeps the attention's output
    and the output projection's input apart (one storage without cp), and with fewer key/value heads
    than cp ranks k and v at the query heads' width. By hand against the same tokens per rank without
    cp: llama-3-8b (32 heads, 8 kv heads of 128) at 4,096 local tokens; rehearsed: +32 MiB a layer
    at cp 2, +160 MiB a layer at cp 16 with 8,192 local tokens (+1.0 and +5.0 GiB in all)."""
    spec = model_preset("llama-3-8b")
    prec = BF16

    def saved(cp: int, checkpoint: str = "none") -> int:
        layout = Layout("fsdp", dp=16, shard=16, cp=cp)
        return memory_breakdown(spec, layout, prec, "adamw", seq=4096 * cp, micro_batch=1,
                                checkpoint=checkpoint).activations

    tokens, layers = 4096, spec.n_layers
    assert saved(2) - saved(1) == layers * tokens * spec.hidden * 2
    assert saved(16) - saved(1) == layers * (tokens * spec.hidden * 2 + 2 * tokens * (32 - 8) * 128 * 2)
    assert saved(2, "full") == saved(1, "full")  # recomputed blocks keep neither


def test_a_pipeline_computes_at_its_busiest_ranks_pace():
    """llama-3-8b's head (4096 x 128,256: 6 h V FLOPs a token) is 1.8 blocks of work at 8,192 tokens: four
    stages of 8 blocks leave the last rank 8 blocks + the head behind the others' 8 blocks; with the
    embedding and the head a block's place each (7, 9, 9, 7 blocks) the busiest are the middle ranks'
    9 blocks, the last at 7 blocks + the head close behind."""
    from shardwise.plan.cost import hardware_flops_per_token, stage_imbalance

    spec = model_preset("llama-3-8b")
    seq = 8192
    total = hardware_flops_per_token(spec, seq, "none")
    head = 6.0 * 4096 * 128256
    block = (total - head) / 32
    assert 1.7 < head / block < 2.0
    even = Layout("fsdp+pp", dp=2, pp=4)
    assert stage_imbalance(spec, even, seq) == pytest.approx(4 * (8 * block + head) / total)
    lighter = dataclasses.replace(even, pp_first_stage_fewer=1)
    assert stage_imbalance(spec, lighter, seq) == pytest.approx(4 * max(9 * block, 7 * block + head) / total)
    assert 1.0 < stage_imbalance(spec, lighter, seq) < stage_imbalance(spec, even, seq)
    assert stage_imbalance(spec, Layout("fsdp", dp=8), seq) == 1.0
    # The step's compute is the busiest rank's: the even split is slower by the ratio.
    fabric = Fabric(gpus_per_node=8, intra_gbs=450, nic_gbs=50, peak_tflops=989)
    from shardwise.plan.cost import step_time

    bf16 = PRECISIONS["bf16"]
    a = step_time(spec, even, bf16, fabric, seq=seq, micro_batch=1, grad_accum=8)
    b = step_time(spec, lighter, bf16, fabric, seq=seq, micro_batch=1, grad_accum=8)
    assert a.compute_s / b.compute_s == pytest.approx(stage_imbalance(spec, even, seq)
                                                      / stage_imbalance(spec, lighter, seq))


def test_selective_op_keeps_every_sequence_parallel_reduce_scatter_and_the_routers_outputs():
    """Per token, by hand, the bytes a block keeps under ``selective-op`` at tp 2 with SP (bf16):
    the block input's shard, the 1st, 3rd, ... matmul outputs, the attention's output and
    log-sum-exp, and the reduce-scatter output of every row-parallel matmul, also the attention's
    output projection, whose matmul is recomputed (rehearsed: +64 bytes a token a block, the tiny
    Llama's +8.5 % activations, llama-3-8b's +256 MiB at tp 8). A mixture of experts' router runs
    whole on each TP rank, and a model that returns its routers' probabilities for the aux loss
    keeps them, fp32, as the block's output (the tiny Mixtral read +19.1 % before)."""
    from shardwise.models.hf_config import load_hf_config_dict
    from shardwise.plan.memory import op_sac_layer_bytes
    from shardwise.plan.spec import from_hf_config_dict

    llama = from_hf_config_dict(load_hf_config_dict("llama-tiny"))
    mixtral_cfg = load_hf_config_dict("mixtral-tiny")
    h, tp, e = 64, 2, 2
    attention = (64 * e + 4 * 4) / tp  # output (4 heads of 16) and fp32 log-sum-exp per head
    # Llama: q, v, gate (column-parallel, split) and down (row-parallel: the whole partial sum) of
    # q, k, v, o, gate, up, down; the reduce-scatters after o and down.
    dense = h * e / tp + 64 * e / tp + 32 * e / tp + 172 * e / tp + h * e + 2 * h * e / tp + attention
    assert op_sac_layer_bytes(llama, 128, 2, e, tp=tp, sp=True) == 256 * dense
    # Without SP nothing is reduce-scattered and the block input is whole.
    assert op_sac_layer_bytes(llama, 128, 2, e, tp=tp, sp=False) == 256 * (dense + h * e / tp - 2 * h * e / tp)
    # Mixtral: q, v and the router (4 experts, whole) of q, k, v, o, router; only o reduce-scattered.
    for returned in (False, True):
        spec = from_hf_config_dict(dict(mixtral_cfg, output_router_logits=returned))
        moe = h * e / tp + 64 * e / tp + 32 * e / tp + 4 * e + h * e / tp + attention + (4 * 4 if returned else 0)
        assert op_sac_layer_bytes(spec, 128, 2, e, tp=tp, sp=True) == 256 * moe


def test_zero_bubble_schedules_recompute_a_checkpointed_block_twice():
    """A split backward's input and weight passes are two autograd calls, and torch's checkpoint
    recomputes a block once per call (parallel/pipeline/pp._recompute_once keeps the weight pass to
    one): under ``interleaved-zb`` a checkpointed block's forward runs three times a micro-batch,
    under ``interleaved-1f1b`` (the same placement and split) twice. The compute and the TP
    collectives charge the second recomputation as the first."""
    from shardwise.plan.cost import DEFAULT_CALIBRATION, micro_batch_compute_s, step_time

    spec = model_preset("llama-3-8b")
    fabric = Fabric(gpus_per_node=8, intra_gbs=450, nic_gbs=50, peak_tflops=989)
    bf16 = PRECISIONS["bf16"]

    def run(schedule: str, checkpoint: str):
        layout = Layout("fsdp+tp+pp", dp=2, tp=2, pp=4, shard=2, pp_schedule=schedule, pp_stages_per_rank=2)
        return step_time(spec, layout, bf16, fabric, seq=4096, micro_batch=1, grad_accum=8, checkpoint=checkpoint)

    def micro(checkpoint: str) -> float:  # one micro-batch's compute on a rank, before the stage balance
        return micro_batch_compute_s(spec, bf16, fabric, seq=4096, micro_batch=1, checkpoint=checkpoint, every=2,
                                     calib=DEFAULT_CALIBRATION, tp=2, pp=4)

    plain, once, twice = run("interleaved-1f1b", "none"), run("interleaved-1f1b", "full"), run("interleaved-zb", "full")
    recomputation = (micro("full") - micro("none")) / micro("full")  # its share of a checkpointed micro-batch
    assert recomputation > 0.2
    assert (twice.compute_s - once.compute_s) / once.compute_s == pytest.approx(recomputation)
    assert run("interleaved-zb", "none").compute_s == pytest.approx(plain.compute_s)
    assert twice.comm_total_s > once.comm_total_s  # the TP collectives of the second recomputation


def test_in_flight_micro_batches_of_a_loss_rank_carry_no_loss_tensors():
    """A loss stage runs each micro-batch's backward right after its forward, so a rank holding the last
    stage keeps its logits and loss tensors for one micro-batch (the activations column); its other
    in-flight micro-batches are its other stages'. The in-flight term of ZBV's rank 0 (both ends) does not
    grow with the vocabulary; it did while every in-flight micro-batch was charged the mean of the rank's
    stages (llama-3-405b ZBV rank 0: 12.4 GiB planned in flight, 5.5 GiB held)."""
    from shardwise.models.hf_config import load_hf_config_dict
    from shardwise.plan.spec import from_hf_config_dict

    cfg = load_hf_config_dict("llama-tiny")
    layout = Layout("fsdp+pp", dp=1, pp=2, shard=1, pp_schedule="zbv", pp_stages_per_rank=2,
                    pp_microbatches=8).with_blocks(8)

    def in_flight(vocab: int, stage: int) -> int:
        spec = from_hf_config_dict(dict(cfg, num_hidden_layers=8, vocab_size=vocab))
        parts = memory_breakdown(spec, layout, PRECISIONS["bf16"], "adamw", seq=128, micro_batch=1,
                                 checkpoint="full", grad_accum=8, stage=stage).transient_parts
        return next(v for k, v in parts.items() if k.startswith("pipeline in-flight"))

    assert in_flight(65, 0) == in_flight(65_000, 0)  # rank 0: stages 0 and 3 (the loss)
    assert in_flight(65, 1) == in_flight(65_000, 1)  # rank 1: two middle stages


def test_a_pending_weight_pass_keeps_its_norms_output_gradients():
    """Under a split backward each pending stage micro-batch keeps the gradients of its weight ops'
    outputs for the deferred weight pass: the matmuls' (column-parallel ones 1/tp wide) and each of the
    block's two norms' outputs, fp32 under autocast, sequence-sharded under SP (read on played ZBV ranks:
    four residual-width gradients a two-layer stage micro-batch beyond the matmuls'). By hand for the tiny
    Llama (hidden 64: q 64, k 32, v 32, o 64, gate 172, up 172, down 64), 128 tokens, two layers a stage."""
    from shardwise.core.pp_schedules import peak_weight_passes_due
    from shardwise.models.hf_config import load_hf_config_dict
    from shardwise.plan.spec import from_hf_config_dict

    spec = from_hf_config_dict(dict(load_hf_config_dict("llama-tiny"), num_hidden_layers=8))

    def pending(strategy: str, tp: int, sp: bool) -> tuple[int, int]:
        layout = Layout(strategy, dp=1, pp=2, tp=tp, shard=1, pp_schedule="zbv", pp_stages_per_rank=2,
                        pp_microbatches=8, sequence_parallel=sp).with_blocks(8)
        parts = memory_breakdown(spec, layout, PRECISIONS["bf16"], "adamw", seq=128, micro_batch=1,
                                 checkpoint="full", grad_accum=8, stage=1).transient_parts
        due = peak_weight_passes_due("zbv", 2, 8, 2, 1)
        return next(v for k, v in parts.items() if k.startswith("weight-op output gradients")), due * 2 * 128

    got, layer_tokens = pending("pp", 1, False)  # autocast: the norms' gradients in fp32
    assert got == layer_tokens * (600 * 2 + 2 * 64 * 4)
    got, layer_tokens = pending("fsdp+tp+pp", 2, True)  # bf16, tp 2, the norms' on the sequence shard
    assert got == layer_tokens * ((32 + 16 + 16 + 64 + 86 + 86 + 64) * 2 + 2 * 64 * 2 / 2)


def test_fused_glu_keeps_three_ffn_widths_a_token_not_four_by_hand(mixtral):
    """``Kernels.glu = "fused"`` (Megatron's bias_swiglu_impl: the activation saves its 2 x ffn input
    and is recomputed in backward; fc2 keeps the product) keeps one ffn-wide tensor a token less
    than eager SwiGLU (gate, up, silu(gate), product), split tp ways with the MLP; a mixture of
    experts one less per routed slot. GELU MLPs (no gate) are unchanged; the megatron stack fuses."""
    from shardwise.errors import ConfigError
    from shardwise.plan.memory import layer_activation_bytes
    from shardwise.plan.stacks import stack_settings

    dense = model_preset("llama-3-8b")  # ffn 14,336
    seq, mb = 8192, 1
    for tp in (1, 4):
        eager = layer_activation_bytes(dense, seq, mb, 2, tp=tp, kernels=Kernels())
        fused = layer_activation_bytes(dense, seq, mb, 2, tp=tp, kernels=Kernels(glu="fused"))
        assert eager - fused == seq * mb * 14336 * 2 // tp
    moe_eager = layer_activation_bytes(mixtral, 4096, 1, 2, kernels=Kernels(experts_whole_on_tp=False))
    moe_fused = layer_activation_bytes(mixtral, 4096, 1, 2, kernels=Kernels(experts_whole_on_tp=False, glu="fused"))
    assert moe_eager - moe_fused == 4096 * mixtral.moe.top_k * mixtral.ffn_hidden * 2
    gpt = model_preset("gpt2")
    assert (layer_activation_bytes(gpt, 1024, 2, 2, kernels=Kernels(glu="fused"))
            == layer_activation_bytes(gpt, 1024, 2, 2, kernels=Kernels()))
    assert stack_settings("megatron")[0].glu == "fused" and stack_settings("shardwise")[0].glu == "eager"
    with pytest.raises(ConfigError, match="gated-MLP activation"):
        Kernels(glu="compiled")
