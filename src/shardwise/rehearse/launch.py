"""Start the played ranks: one process each (``shardwise.rehearse.worker``), a few at a time, each
with a time limit; collect their JSON results.

A process per rank because a process group, a mesh and torch's global state belong to one rank:
two played ranks in one process would share them. The processes fork from a server that imported
torch, transformers and the worker once (``shardwise.forkserver``): importing them is seconds of
CPU per played rank, the most of a small rank's rehearsal. Each starts clean, with the environment
given here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.forkserver import adopt_environment, preloaded_context
from shardwise.rehearse.worker import DEVICES, PROGRESS, PlaySpec
from shardwise.rehearse.worker import main as worker_main


def parse_ranks(text: str, world_size: int) -> list[int]:
    """``--ranks``: comma-separated ranks (or ``a-b`` ranges), each in [0, world_size)."""
    ranks: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ConfigError(f"--ranks takes ranks and ranges separated by commas (e.g. 0,7,56-63), "
                              f"got {text!r}.") from None
        if not 0 <= first <= last < world_size:
            raise ConfigError(f"--ranks {part!r} is outside this run's ranks 0..{world_size - 1} "
                              f"(world size {world_size}).")
        ranks.update(range(first, last + 1))
    if not ranks:
        raise ConfigError("--ranks is empty; name at least one rank, e.g. --ranks 0.")
    return sorted(ranks)


def default_ranks(layout: Any) -> list[int]:
    """One rank of each distinct role: rank 0 (the first pipeline stage, shard 0, every group's
    first member, the first chunk of each sequence and the first experts); the first rank of the
    pipeline rank that holds the last stage (the head and the loss) and of the last pipeline rank
    (the same one, except in a V schedule, where rank 0 holds the last stage and the last rank the
    turn of the V); the first rank holding the last chunk of each sequence (context parallel) and
    the first holding the last experts (expert parallel); and the last rank (the last shard of
    every sharded dimension, where FSDP's padding falls)."""
    ranks = {0, layout.world_size - 1}

    def first(role: Any) -> int:
        return next(r for r in range(layout.world_size) if role(r))

    if layout.pp > 1:
        last_stage = next(p for p in range(layout.pp) if layout.holds_last_stage(p))
        ranks.update(first(lambda r, p=p: layout.coords(r)["pp"] == p) for p in {last_stage, layout.pp - 1})
    if layout.cp > 1:
        ranks.add(first(lambda r: layout.cp_rank(r) == layout.cp - 1))
    if layout.ep > 1:
        # Expert groups are consecutive data-parallel ranks (parallel/mesh.py): the ep index is the
        # data-parallel index modulo ep.
        def dp_index(r: int) -> int:
            return layout.coords(r)["dp"] if layout.info.model_parallel else r

        ranks.add(first(lambda r: dp_index(r) % layout.ep == layout.ep - 1))
    return sorted(ranks)


def check_device(device: str) -> None:
    """Refuse a device this machine cannot play ranks on."""
    import torch  # defers torch

    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda plays a rank on this machine's GPU with real tensors, and this machine "
                          "has none (or torch is a CPU build). Leave --device out to play ranks on fake cpu "
                          "tensors, or run on a machine with a GPU.")


def _played_rank(spec_path: str, env: dict[str, str], log_path: str) -> None:
    """One played rank's process: the environment and output ``play`` gives it, then the worker."""
    adopt_environment(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    code = worker_main([spec_path])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown after the work is done (job/exit.py)


def _relay_progress(rank: int, log_path: Path, offset: int) -> int:
    """Print the progress lines a played rank wrote to its log since ``offset``; the new offset."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    end = chunk.rfind(b"\n") + 1  # whole lines only: a line being written is read next time
    for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
        if line.startswith(PROGRESS):
            print(f"rehearse: rank {rank}: {line[len(PROGRESS):]}", file=sys.stderr, flush=True)
    return offset + end


def play(config_toml: str, *, world_size: int, nproc: int, ranks: list[int], device: str = "cpu",
         steps: int = 3, timeout_s: float = 600.0, jobs: int = 1) -> list[dict[str, Any]]:
    """Run each of ``ranks`` as its own process; return their results in rank order."""
    check_device(device)
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shardwise-rehearse-") as tmp:
        config_path = Path(tmp) / "config.toml"
        config_path.write_text(config_toml, encoding="utf-8")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # fake cpu tensors even on a machine with GPUs
        ctx = preloaded_context()
        pending = list(ranks)
        running: dict[int, tuple[Any, float, Path]] = {}
        relayed: dict[int, int] = {}  # each running rank's log offset read so far
        while pending or running:
            while pending and len(running) < max(1, jobs):
                rank = pending.pop(0)
                spec = PlaySpec(str(config_path), rank, world_size, nproc, device, steps,
                                str(Path(tmp) / f"rank{rank}.json"))
                spec_path = Path(tmp) / f"spec{rank}.json"
                spec_path.write_text(json.dumps(asdict(spec)), encoding="utf-8")
                proc = ctx.Process(target=_played_rank, args=(str(spec_path), env, str(Path(tmp) / f"rank{rank}.log")),
                                   name=f"played-rank-{rank}")
                proc.start()
                running[rank] = (proc, time.monotonic(), Path(spec.result_path))
            time.sleep(0.05)
            for rank, (proc, t0, result_path) in list(running.items()):
                relayed[rank] = _relay_progress(rank, Path(tmp) / f"rank{rank}.log", relayed.get(rank, 0))
                if proc.is_alive() and time.monotonic() - t0 < timeout_s:
                    continue
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                    results[rank] = {"rank": rank, "failed": f"played rank {rank} ran past {timeout_s:.0f} s"}
                    del running[rank]
                    continue
                proc.join()  # reap it
                _relay_progress(rank, Path(tmp) / f"rank{rank}.log", relayed.pop(rank, 0))
                if result_path.is_file():
                    results[rank] = json.loads(result_path.read_text(encoding="utf-8"))
                else:
                    tail = (Path(tmp) / f"rank{rank}.log").read_text(encoding="utf-8", errors="replace")[-2000:]
                    results[rank] = {"rank": rank, "failed": f"played rank {rank} exited with code "
                                     f"{proc.exitcode} before writing its result", "traceback": tail}
                del running[rank]
    return [results[r] for r in ranks]
