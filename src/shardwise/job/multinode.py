"""How the nodes of one multi-node job find each other and agree on one run directory.

Every node runs the same ``shardwise train --nnodes N --rdzv-endpoint HOST:PORT`` command. They
need three things in common before any rank starts:

* **a rendezvous id** (torchrun's ``--rdzv-id``): ``--rdzv-id``/``--job-id`` when given, else the
  scheduler's job id (Slurm ``SLURM_JOB_ID``, PBS ``PBS_JOBID``, LSF ``LSB_JOBID``), else one
  derived from what every node's command has in common (the endpoint, the node count and the
  resolved config), never from a clock, which differs between nodes started seconds apart;
* **one run directory**: the first launcher to reach the rendezvous proposes its ``--out`` (or
  its default ``runs/<name>-<strategy>-<time>``, resolved to an absolute path) and every other
  node adopts it, so nodes started from different working directories, or a second later, still
  write into one directory, and running the same command twice still makes two runs;
* **one launch id** (``SHARDWISE_LAUNCH_ID``): checkpoints and heartbeats name the job by it, so
  a checkpoint written while rank 0 ran on one node is rotated by a later attempt whose rank 0
  runs on another.

They are exchanged through the rendezvous endpoint itself: the launcher on the endpoint's host
serves a ``TCPStore`` there (torchrun's c10d rendezvous then uses the same store), and the others
connect to it. Keys are namespaced by the rendezvous id.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.fsutil import real_path

# Scheduler job ids, in the order they are looked up; each is set on every node of an allocation.
SCHEDULER_JOB_IDS = (("SLURM_JOB_ID", "Slurm"), ("PBS_JOBID", "PBS"), ("LSB_JOBID", "LSF"))
RDZV_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_JOIN_TIMEOUT_S = 600.0  # torchrun's own rendezvous join timeout


def check_rdzv_id(value: str, flag: str = "--rdzv-id") -> str:
    """Return ``value`` when it can name a rendezvous and a run directory; ConfigError otherwise."""
    if not RDZV_ID_PATTERN.match(value):
        raise ConfigError(f"{flag} must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter "
                          f"or digit), the same on every node; got {value!r}.")
    return value


def scheduler_job_id(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(job id, scheduler)`` of the allocation this process runs in, None outside one."""
    env = os.environ if env is None else env
    for var, scheduler in SCHEDULER_JOB_IDS:
        value = env.get(var, "").strip()
        if value:
            return re.sub(r"[^A-Za-z0-9._-]", "_", value)[:128], scheduler
    return None


def rendezvous_id(explicit: str, endpoint: str, nnodes: str, config_toml: str,
                  env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The job's rendezvous id and where it came from (``--rdzv-id``, ``SLURM_JOB_ID``, ``derived``).

    The derived id hashes what every node's command shares (endpoint, node count, resolved
    config): identical on all nodes wherever and whenever they start.
    """
    if explicit:
        return check_rdzv_id(explicit), "--rdzv-id"
    found = scheduler_job_id(env)
    if found:
        return found[0], f"{found[1]} job id"
    digest = hashlib.sha256("\n".join((endpoint, nnodes, config_toml)).encode()).hexdigest()[:12]
    return f"sw-{digest}", "derived from the endpoint, node count and config"


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """``(min, max)`` of ``--nnodes N`` or ``--nnodes MIN:MAX`` (torchrun's elastic range)."""
    text = str(value).strip()
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ConfigError(f"--nnodes must be a node count N or an elastic range MIN:MAX (e.g. 2 or 2:4), "
                          f"got {text!r}.") from None
    if low < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {text!r}.")
    if high < low:
        raise ConfigError(f"--nnodes {text}: MIN ({low}) is larger than MAX ({high}); write MIN:MAX with "
                          "MIN <= MAX, e.g. 2:4.")
    return low, high


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def check_endpoint_resolves(endpoint: str) -> None:
    """Raise ConfigError when the endpoint's host name does not resolve (a typo would hang the nodes)."""
    host, port = split_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: the host {host!r} does not resolve ({e}). Give "
                          "the first node's host name or IP address, reachable from every node.") from None


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine: torchrun's test (its host name, loopback), or one of
    the host's addresses can be bound here (an address on a second interface, which torchrun's
    name-based test misses)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname  # defers torch

    if _matches_machine_hostname(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))  # only an address of this machine can be bound
            return True
        except OSError:
            continue
    return False


@dataclass
class Agreement:
    """What the nodes agreed on, and the store that serves it while this launcher lives."""

    run_dir: Path
    launch_id: str
    first: bool  # this launcher arrived first: its proposal is the run directory
    key: str = ""  # the job's key prefix in the store
    store: Any = None  # the TCPStore (server on the endpoint's host); kept alive with this object

    def publish_ready(self, error: str = "") -> None:
        """Tell the other nodes that the run directory is set up (config.toml written), or why not."""
        self.store.set(f"{self.key}/ready", f"error:{error}" if error else "ok")

    def wait_ready(self) -> None:
        """Wait until the node that set up the run directory says it is ready; raise its error if it refused."""
        try:
            value = self.store.get(f"{self.key}/ready").decode()
        except (RuntimeError, TimeoutError, OSError) as e:
            raise ConfigError(f"the node that set up the run directory {self.run_dir} never said it was "
                              f"ready ({e}); see its output.") from None
        if value.startswith("error:"):
            raise ConfigError(f"the node that set up the run directory refused the run: {value[6:]}")


def agree(endpoint: str, rdzv_id: str, proposal: Path, launch_id: str,
          timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> Agreement:
    """Agree with the other nodes of ``rdzv_id`` on the run directory and launch id (see the module doc).

    Serves the store when the endpoint is this host and its port is free, else connects to it;
    waits up to ``timeout_s`` for the node that serves it. Raises ConfigError when none comes.
    """
    from torch.distributed import TCPStore  # defers torch

    host, port = split_endpoint(endpoint)
    store = None
    if is_local_host(host):
        try:
            store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, OSError):
            store = None  # the port is taken: another node on this host serves it (or a stale one)
    if store is None:
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, OSError, TimeoutError) as e:
            raise ConfigError(
                f"no node answered at the rendezvous endpoint {endpoint} within {timeout_s:.0f}s ({e}). "
                f"Start the same command on the node {host!r} (the endpoint must be one of its "
                "addresses, reachable from every node, and the port free)."
            ) from None
    key = f"shardwise/{rdzv_id}"
    proposed = str(real_path(proposal))
    # The first launcher to arrive decides; the others (and a node rejoining later) read it.
    first = store.add(f"{key}/arrivals", 1) == 1
    if first:
        store.set(f"{key}/launch_id", launch_id)
        store.set(f"{key}/run_dir", proposed)  # set last: once readable, both are
    try:
        run_dir = store.get(f"{key}/run_dir").decode()
        job = store.get(f"{key}/launch_id").decode()
    except (RuntimeError, TimeoutError, OSError) as e:
        raise ConfigError(f"the first node of the job never published its run directory ({e}); "
                          "see its output.") from None
    return Agreement(Path(run_dir), job, first=first, key=key, store=store)


# ------------------------------------------------------------------------------ Slurm
@dataclass(frozen=True)
class SlurmEnvironment:
    """A Slurm allocation as seen from one task (like Lightning's ``SLURMEnvironment``)."""

    job_id: str
    nnodes: int
    node_rank: int
    master_addr: str


def expand_first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[003-005,9],cpu1`` -> ``gpu003``."""
    text = nodelist.strip()
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", text)
    if not match:
        return text
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_environment(env: Mapping[str, str] | None = None) -> SlurmEnvironment | None:
    """The Slurm allocation this process runs in as a task, None outside one (or in an interactive shell).

    As Lightning does: a job id and a node list must be set, and an interactive allocation
    (``SLURM_JOB_NAME`` bash or interactive) is not treated as a launcher.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "").strip()
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    if not job_id or not nodelist or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    nnodes_text = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES", "1")
    try:
        nnodes = int(nnodes_text)
        node_rank = int(env.get("SLURM_NODEID", "0"))
    except ValueError:
        raise ConfigError(f"the Slurm environment is inconsistent: SLURM_NNODES={nnodes_text!r}, "
                          f"SLURM_NODEID={env.get('SLURM_NODEID')!r} are not numbers.") from None
    return SlurmEnvironment(job_id=job_id, nnodes=nnodes, node_rank=node_rank,
                            master_addr=expand_first_host(nodelist))
