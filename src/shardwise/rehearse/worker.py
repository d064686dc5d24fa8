"""One played rank: rank r of N in torch's ``fake`` process group, through the real Session.

Run as ``python -m shardwise.rehearse.worker SPEC.json`` (one process per played rank, started by
``rehearse.launch``); writes its result as JSON to the path the spec names. The process group is
initialised here, before the Session, which then finds it and builds its mesh on it. On ``cpu``
every tensor is a FakeTensor (shapes, dtypes and devices, no storage); on ``cuda`` the rank holds
real tensors on the real GPU and only the collectives are fake.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.core.config import load_config
from shardwise.errors import ShardwiseError

# Played ranks on a CPU build hold fake ``cpu`` tensors: FSDP2's fully_shard asks
# torch.cuda.current_device(), which a CPU build refuses, even for fake ``cuda`` tensors.
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class PlaySpec:
    """What one played-rank process runs."""

    config_path: str  # the resolved run's TOML
    rank: int
    world_size: int
    nproc: int  # ranks per node of the rehearsed job
    device: str  # "cpu": fake tensors; "cuda": real tensors on this machine's GPU
    steps: int  # optimizer steps; all but the last are memory-tracked, the last counts collectives and ops
    result_path: str


def _fake_group(rank: int, world_size: int, nproc: int) -> None:
    import torch.distributed as dist  # defers torch
    from torch.testing._internal.distributed.fake_pg import FakeStore  # defers torch

    # The Session reads the standard torchrun variables; LOCAL_RANK 0 picks this machine's one GPU.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE=str(nproc))
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _to_empty_keeping_ties(module: Any, device: Any) -> None:
    """``module.to_empty(device)`` with tied parameters one Parameter again afterwards, as the
    runtime's own materialisation does (``InitProgram._retie``): ``to_empty`` allocates every
    registration of a shared meta parameter separately. The FSDP strategies shard before this and
    keep one parameter per tie; a model allocated whole (DDP, ZeRO-1) came out with its tied
    embedding and head split, which the runtime's tie check refuses (GPT-2, until 2026-11-28)."""
    from shardwise.parallel.ties import retie, tied_groups  # defers torch

    groups = tied_groups(module)
    module.to_empty(device=device)
    retie(module, groups)


def _allocator(device: str) -> tuple[Any, Any]:
    """(the tensor mode the steps run in, the Session's ``allocate`` hook)."""
    import torch  # defers torch

    if device == "cuda":
        # Real tensors, uninitialised: the values do not matter to memory or time.
        return contextlib.nullcontext(), _to_empty_keeping_ties
    from torch._subclasses.fake_tensor import FakeTensorMode  # defers torch

    # Non-fake inputs: the batches come from the real data loader and are converted on entry.
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def allocate(module: torch.nn.Module, target: torch.device) -> None:
        with mode:
            _to_empty_keeping_ties(module, target)

    return mode, allocate


def _draw(make_loader: Any, count: int) -> list[Any]:
    """``count`` micro-batches, from as many passes over the data as they take (the trainer's epochs):
    a big job's steps can outnumber the built-in text's samples per rank (Mixtral's batch of 256 x
    4,096 tokens on 64 ranks: a StopIteration on the first pass before 2026-11-28); the played
    rank needs the batches' shapes, not new text."""
    drawn: list[Any] = []
    loader = make_loader()
    while len(drawn) < count:
        try:
            drawn.append(next(loader))
        except StopIteration:
            if not drawn:
                raise ShardwiseError("the training data gave this rank no batch: it has fewer samples than one "
                                     "micro-batch per data-parallel rank (train.micro_batch_size x the dp ranks); "
                                     "give more data (data.path) or a smaller batch.") from None
            loader = make_loader()
    return drawn


def _one_sequence_per_row() -> None:
    """Make transformers read a fake tensor's positions as one sequence per row, which is what
    they are in every batch this applies to (plain token rows: the model numbers each row 0..T-1,
    context parallel shifts a chunk's numbers by its offset, still consecutive).

    transformers (``masking_utils.find_packed_sequence_indices``) asks whether a row's positions
    restart (packed documents); a fake tensor has no values to answer with, so it counts it as
    tracing and answers "packed", and the model then builds an explicit causal mask for the rank's
    chunk: ``(B, 1, T, T)`` bytes a real run does not hold, and a mask context-parallel attention
    refuses. The real run answers "one sequence" and runs SDPA with ``is_causal``. Patched in this
    worker process only (one played rank); batches with document or padding side inputs are left
    to transformers' own answer, which builds their mask as a real run does.
    """
    from torch._subclasses.fake_tensor import is_fake  # defers torch
    from transformers import masking_utils  # defers transformers (optional)

    find = masking_utils.find_packed_sequence_indices

    def find_on_fake(position_ids: Any) -> Any:
        return None if is_fake(position_ids) else find(position_ids)

    masking_utils.find_packed_sequence_indices = find_on_fake


PROGRESS = "[rehearse progress] "


def progress(message: str) -> None:
    """One line of a played rank's progress into its log, which ``launch.play`` relays as it comes
    (a 70B rank takes minutes: a user, or a time-boxed script, sees how far it got)."""
    print(PROGRESS + message, file=sys.stderr, flush=True)


def play_rank(spec: PlaySpec) -> dict[str, Any]:
    """Prepare the model for this rank, run ``spec.steps`` real steps, and return the measurements."""
    import torch  # defers torch

    from shardwise.rehearse.fake_ddp import NOTE, reducers, standing_in  # defers torch
    from shardwise.rehearse.measure import CollectiveLog, MemoryProbe, group_names, peak_rss_bytes  # defers torch
    from shardwise.rehearse.roofline import OpCounter  # defers torch
    from shardwise.rehearse.save_plan import local_save_plan  # defers torch
    from shardwise.runtime.session import Session  # defers torch
    from shardwise.runtime.trainer import build_optimizer  # defers numpy and torch
    from shardwise.workloads import build_workload  # defers torch

    started = time.perf_counter()
    _fake_group(spec.rank, spec.world_size, spec.nproc)
    cfg = load_config(spec.config_path, [])
    t = cfg.train
    session = Session(parallel=cfg.parallel, grad_accum_steps=t.grad_accum_steps, seed=t.seed,
                      loss_chunks=t.loss_chunks)
    notes: list[str] = []
    mode, session.allocate = _allocator(spec.device)
    workload = build_workload(cfg.model, cfg.data, cfg.lora)
    if not workload.plain_token_ce:
        session.loss_chunks = 0  # as the trainer: only the token-mean CE is chunked
    model = session.build(workload.build_model, init="meta")
    # Torch's DDP, built inside prepare where the strategy replicates with it, gets the rehearsal's
    # stand-in for its C++ reducer (rehearse/fake_ddp.py: the C++ one allocates real buffers and
    # needs real all-reduce results); nothing else changes.
    with standing_in():
        # The run's own [optimizer] (Adafactor, Muon, SGD...): its state is a column the plan predicts.
        model, optimizer = session.prepare(model, build_optimizer(model, t, session.device, cfg.optimizer))
    notes += session.notes
    prepared_s = time.perf_counter() - started
    progress(f"prepared in {prepared_s:.1f} s")
    collate_fn = workload.collate_fn
    if collate_fn is not None and session.layout.pp > 1:
        from shardwise.parallel.pipeline.pp import fixed_shape_collate  # defers torch

        collate_fn = fixed_shape_collate(collate_fn)
    # At least two memory-tracked steps: the optimizer's state exists only from the first step's
    # end, so a peak read from the first step alone misses it (a 70B rank read 21 % low that way).
    tracked = max(2, spec.steps - 1)
    cuda = spec.device == "cuda"
    # On a GPU one more step runs with no tracker and no counter: the others are slowed by them
    # (a played llama-3-70b rank's counted step took 16.3 s on an H200, its per-op Python work), so
    # its time alone is the rank's compute.
    timed = 1 if cuda else 0
    # Drawn before the tensor mode is entered: the loader's sampler reads real values.
    drawn = _draw(lambda: iter(session.dataloader(workload.train_set, t.micro_batch_size, seed=t.seed,
                                                  collate_fn=collate_fn)), (tracked + 1 + timed) * t.grad_accum_steps)
    if spec.device == "cpu" and cfg.model.kind == "hf" and all(isinstance(x, torch.Tensor) for x, _ in drawn):
        _one_sequence_per_row()
    batches = iter(drawn)
    # Under a pipeline the schedule runs the stages, never the union model's own forward.
    pipeline = getattr(session.strategy, "pipeline", None)
    probe = MemoryProbe(model, optimizer, stages=[s.submod for s in pipeline.stages] if pipeline else None,
                        loss_stage=next((i for i, s in enumerate(pipeline.stages) if s.is_last), None)
                        if pipeline else None)
    stand_ins = reducers([model, *(s.submod for s in pipeline.stages)] if pipeline else [model])
    for reducer in stand_ins:
        reducer.track_with(probe.tracker)  # its buckets: persistent, filed "Other" (the transients column)
    if stand_ins:
        notes.append(NOTE)
    if pipeline is not None:
        from shardwise.rehearse.fake_p2p import LocalNeighbours, boundary_dtype, hidden_size  # defers torch

        # The fake group delivers no message: the schedule's pre-step vote and shape exchange are
        # answered on this rank (rehearse/fake_p2p.py); its steps then run as on a cluster.
        LocalNeighbours(pipeline, hidden_size(model), boundary_dtype(cfg.parallel.precision,
                                                                     session.layout.info.dp_kind))
    # Context and expert parallel run on views of their own (parallel/mesh.py): their groups too.
    views = (session.meshes.sparse, session.meshes.batch) if session.meshes is not None else ()
    collectives = CollectiveLog({k: v for m in (*views, session.mesh) for k, v in group_names(m).items()})
    step_s: list[float] = []

    def one_step() -> None:
        t0 = time.perf_counter()
        for _ in range(t.grad_accum_steps):
            x, y = next(batches)
            session.forward_backward(model, session.to_device(x), y.to(session.device), workload.loss_fn)
            probe.end_micro_batch()
        # The ledger's gradient walk keys storages by data pointer, which fake tensors do not have.
        session.step(optimizer, max_norm=t.grad_clip, measure_grad_bytes=False)
        if cuda:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        what = ("memory tracked" if len(step_s) <= tracked else "collectives and FLOPs counted"
                if len(step_s) == tracked + 1 else "timed alone")
        progress(f"step {len(step_s)} of {tracked + 1 + timed} in {step_s[-1]:.1f} s ({what})")

    with mode:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with probe.tracker:
            for _ in range(tracked):
                one_step()
        memory = probe.result()
        # The last step (untracked for memory) also counts every op's FLOPs and bytes: the roofline.
        counter = OpCounter()
        with collectives, counter:
            one_step()
        for _ in range(timed):
            one_step()
    try:
        # Outside the fake mode: DCP computes each shard's offset from the mesh's real coordinates.
        save_plan = local_save_plan(model, optimizer, rank=spec.rank, trainable_only=session.trainable_only)
    except Exception as e:  # noqa: BLE001 - reported as not rehearsed, never as a number
        save_plan = {"not_rehearsed": f"{type(e).__name__}: {str(e)[:300]}"}
    result: dict[str, Any] = {
        "rank": spec.rank, "device": spec.device, "coords": session.layout.coords(spec.rank),
        "memory": memory, "modules": memory.pop("modules"), "save_plan": save_plan, "collectives": collectives.result(),
        "compute": counter.result(),
        "collective_steps": 1, "timed_step_s": round(step_s[-1], 4) if timed else None,
        "prepare_s": round(prepared_s, 3), "step_s": [round(s, 4) for s in step_s],
        "wall_s": round(time.perf_counter() - started, 3), "peak_rss_bytes": peak_rss_bytes(), "notes": notes,
    }
    if cuda:
        result["cuda"] = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                          "max_memory_reserved": torch.cuda.max_memory_reserved(),
                          "device_name": torch.cuda.get_device_name()}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = PlaySpec(**json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    try:
        result = play_rank(spec)
    except ShardwiseError as e:
        # A rule the run breaks at this size: the same one-paragraph message a real launch prints.
        result = {"rank": spec.rank, "refused": str(e), "kind": type(e).__name__}
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which prints it as a failure of this rank
        result = {"rank": spec.rank, "failed": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=12)}
    Path(spec.result_path).write_text(json.dumps(result, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    from shardwise.job.exit import exit_rank

    exit_rank(main())  # no interpreter teardown after the work is done (job/exit.py)
