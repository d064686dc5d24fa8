"""Turn a resolved run into a torchrun (``torch.distributed.run``) invocation, or run in-process.

We never spawn ranks ourselves for real runs: torchrun owns rendezvous, per-rank environment,
elastic restarts and multi-node. This module only builds its command line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.job.agent import REPORT_ENV
from shardwise.job.multinode import check_endpoint_resolves, parse_nnodes
from shardwise.runtime.lifeline import launcher_env

MAX_NODES = 4096
MAX_NPROC = 4096
MAX_RESTARTS = 1000


@dataclass
class LaunchSpec:
    nproc: int
    nnodes: int | str = 1  # a count, or torchrun's elastic range "MIN:MAX"
    node_rank: int = 0
    rdzv_endpoint: str = ""  # "host:port" for multi-node; empty means --standalone
    max_restarts: int = 0
    run_id: str = ""
    local_addr: str = ""  # this node's address for the others (torchrun --local-addr)

    @property
    def multi_node(self) -> bool:
        return str(self.nnodes) != "1" or bool(self.rdzv_endpoint)


def check_launch_flags(nproc: int | None, nnodes: int | str, node_rank: int, rdzv_endpoint: str,
                       max_restarts: int) -> tuple[int, int]:
    """Raise ConfigError for launch flags that cannot work (before anything starts, never a hang).

    ``nnodes`` is a count or an elastic range ``MIN:MAX``; returns ``(min, max)``. ``--nnodes > 1``
    needs ``--rdzv-endpoint HOST:PORT`` (without one every node would wait for the others on its
    own localhost forever), and ``--node-rank`` must lie in ``[0, max nodes)``.
    """
    if nproc is not None and not 1 <= nproc <= MAX_NPROC:
        raise ConfigError(f"--nproc must be at least 1 (and at most {MAX_NPROC}), got {nproc}.")
    low, high = parse_nnodes(nnodes)
    if high > MAX_NODES:
        raise ConfigError(f"--nnodes must be at least 1 (and at most {MAX_NODES}), got {nnodes}.")
    if not 0 <= node_rank < high:
        raise ConfigError(f"--node-rank must be between 0 and --nnodes - 1 = {high - 1}, got {node_rank}. "
                          "Give each node its own rank: 0 on the first, 1 on the second, ...")
    if not 0 <= max_restarts <= MAX_RESTARTS:
        raise ConfigError(f"--max-restarts must be between 0 and {MAX_RESTARTS}, got {max_restarts}.")
    if rdzv_endpoint:
        host, sep, port = rdzv_endpoint.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535 \
                or not host.isprintable() or " " in host:
            raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (e.g. node0:29500, port 1-65535), "
                              f"got {rdzv_endpoint!r}.")
        if high > 1:
            check_endpoint_resolves(rdzv_endpoint)
    elif high > 1:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the address of the first "
                          "node (the same on every node), e.g. --rdzv-endpoint node0:29500; without it "
                          "each node would wait for the others on its own localhost.")
    return low, high


def torchrun_args(spec: LaunchSpec) -> list[str]:
    """torchrun options for ``spec`` (what follows ``python -m torch.distributed.run``).

    Multi-node runs use the c10d rendezvous, which assigns node ranks in join order: torchrun
    ignores (and warns about) ``--node-rank`` there, so it is not passed.
    """
    args = [f"--nproc-per-node={spec.nproc}"]
    if spec.multi_node:
        args += [f"--nnodes={spec.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={spec.rdzv_endpoint or 'localhost:29500'}"]
        if spec.run_id:
            args.append(f"--rdzv-id={spec.run_id}")
        if spec.local_addr:
            args.append(f"--local-addr={spec.local_addr}")
    else:
        # A free port on localhost, chosen by torchrun: two jobs on one machine never collide.
        args.append("--standalone")
    if spec.max_restarts:
        args.append(f"--max-restarts={spec.max_restarts}")
    return args


def nccl_flight_recorder_env(out: str | os.PathLike, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment that makes NCCL collectives leave a flight-recorder trace in ``<out>/nccl-trace/``.

    PyTorch's ProcessGroupNCCL records the last collectives of every rank in a ring buffer
    (``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) and, with
    ``TORCH_NCCL_DUMP_ON_TIMEOUT``, writes it to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` (formerly
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) when a collective times out; ``torchfrtrace`` reads the
    dumps. Only NCCL reads these variables (gloo and CPU runs ignore them). Values the user set
    are kept.
    """
    environ = os.environ if environ is None else environ
    defaults = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(out) / "nccl-trace" / "rank_"),
    }
    aliases = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
               "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    return {k: v for k, v in defaults.items() if k not in environ and aliases.get(k) not in environ}


def torchrun_command(spec: LaunchSpec, target: Sequence[str]) -> list[str]:
    """Full argv: ``python -m torch.distributed.run <options> <target...>``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(spec), *target]


def run_torchrun(spec: LaunchSpec, target: Sequence[str], env: dict[str, str] | None = None,
                 agent_report: str | os.PathLike | None = None) -> int:
    """Run torchrun in the foreground and return its exit code.

    The agent is ``shardwise.job.agent`` (torchrun itself, tied to this process's life and
    without torchrun's tracebacks); with ``agent_report`` it writes the failing ranks there as
    JSON (see ``job.agent``). The agent and every rank die with this process (see
    ``runtime.lifeline``), so a killed launcher leaves no rank behind.
    """
    full_env = dict(os.environ, **(env or {}), **launcher_env())
    if agent_report is not None:
        full_env[REPORT_ENV] = str(agent_report)
    # One thread per CPU rank unless the user chose otherwise; torchrun does the same but warns.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.job.agent", *torchrun_args(spec), *target],
                            env=full_env)
    # While torchrun runs, this process must not die on a signal: subprocess.call would SIGKILL
    # torchrun on KeyboardInterrupt, orphaning ranks that are saving their interrupt checkpoint.
    # SIGTERM and SIGINT sent to this process alone (a scheduler, `kill -INT`) are forwarded to
    # the agent, which passes them to every rank (save, then stop); Ctrl-C reaches the agent
    # twice (terminal and here), and the agent ignores the second.
    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            proc.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        return proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# Options of `shardwise launch` itself (each takes a value); every other option before the script
# is torchrun's and passed through.
LAUNCH_OWN_OPTIONS = frozenset({"--nproc", "--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank",
                                "--node_rank", "--rdzv-endpoint", "--rdzv_endpoint", "--max-restarts",
                                "--max_restarts"})


def split_launch_argv(tokens: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Split ``shardwise launch`` arguments into (its own options, torchrun options, script and its args).

    torchrun options may be written ``--opt value`` or ``--opt=value``; which ones take a value is
    read from torchrun's own parser, so ``--master-port 29501 train.py`` passes ``--master-port
    29501`` and runs ``train.py``. ``--`` ends the options. An option torchrun does not know is a
    ConfigError (it would otherwise be taken for the script).
    """
    from torch.distributed.run import get_args_parser  # defers torch

    actions = get_args_parser()._option_string_actions  # noqa: SLF001 - the parser's own option table
    own: list[str] = []
    passthrough: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return own, passthrough, list(tokens[i + 1:])
        if not token.startswith("-") or token == "-":
            return own, passthrough, list(tokens[i:])
        name, has_value, _ = token.partition("=")
        if name in ("-h", "--help"):
            own.append(token)
            i += 1
            continue
        takes_value = True
        target = own
        if name not in LAUNCH_OWN_OPTIONS:
            action = actions.get(name)
            if action is None:
                raise ConfigError(f"shardwise launch: {name} is neither a shardwise launch option (--nproc, "
                                  "--nnodes, --node-rank, --rdzv-endpoint, --max-restarts) nor a torchrun "
                                  "option (see `python -m torch.distributed.run --help`). Options go before "
                                  "the script; the script's own options after it.")
            takes_value = action.nargs != 0
            target = passthrough
        if takes_value and not has_value:
            if i + 1 >= len(tokens):
                raise ConfigError(f"shardwise launch: {name} needs a value (write {name} VALUE or {name}=VALUE).")
            target += [token, tokens[i + 1]]
            i += 2
        else:
            target.append(token)
            i += 1
    return own, passthrough, []
