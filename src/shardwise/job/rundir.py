"""The run directory contract: config.toml, metrics.jsonl (rank 0), summary.json, checkpoints/.

A run directory belongs to one job at a time (``job.runlock``), and a fresh run never writes
into a directory that already holds a run: ``claim_run_dir`` lets a job in only when it continues
the run there (``--resume``, ``checkpoint.resume = "auto"`` with a ``latest`` checkpoint, or the
same job restarted before its first checkpoint), or when ``--overwrite`` has moved the old run
aside (renamed, never deleted).
"""

from __future__ import annotations

import datetime
import os
import sys
import tomllib
from pathlib import Path

from shardwise.core.config import RunConfig, check_text, to_toml
from shardwise.core.run_files import CHECKPOINTS_DIR, RUN_FILES
from shardwise.errors import ConfigError
from shardwise.fsutil import real_path, what_is
from shardwise.job.runlock import GUARD_FILE, LOCK_FILE, RunLock


def holds_run(path: Path) -> bool:
    """True when ``path`` holds (part of) a run: a config, metrics, a summary or checkpoints."""
    return any((Path(path) / name).exists() for name in RUN_FILES)


def check_out_dir(out: str | os.PathLike, flag: str = "--out") -> Path:
    """Create the run directory ``out`` if needed and return it; ConfigError says what is wrong."""
    text = os.fspath(out)
    check_text(flag, text, kind="path")
    path = Path(text)
    if os.path.lexists(path) and not path.is_dir():
        raise ConfigError(f"{flag} {text!r} {what_is(path)}, not a directory; choose a directory "
                          "for the run (it is created if missing).")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run directory {flag} {text!r}: {e.strerror or e}. "
                          "Choose a directory you can write to.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write into the run directory {flag} {text!r} (permission denied); "
                          "choose a directory you can write to.")
    return path


def move_run_aside(path: Path) -> Path:
    """Move everything in ``path`` but the lock into a new sibling ``<name>.old-<time>``; return it.

    The lock stays where it is, so no other job can slip into ``path`` meanwhile; every file is
    renamed, never copied or deleted, so the old run stays whole and resumable at its new place.
    """
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        aside = path.with_name(f"{path.name}.old-{stamp}" + (f"-{n}" if n else ""))
        try:
            aside.mkdir()
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"--overwrite cannot create {aside} to move the old run into: "
                              f"{e.strerror or e}.") from None
    else:  # pragma: no cover - a thousand moves within one second
        raise ConfigError(f"--overwrite: too many runs moved aside from {path} this second.")
    try:
        for entry in sorted(path.iterdir()):
            if entry.name not in (LOCK_FILE, GUARD_FILE):
                os.rename(entry, aside / entry.name)
    except OSError as e:
        raise ConfigError(f"--overwrite could not move the old run from {path} to {aside}: "
                          f"{e.strerror or e}. What was moved is in {aside}; nothing was deleted.") from None
    return aside


def _holds_run_error(out: Path) -> ConfigError:
    return ConfigError(
        f"{out} already holds a run (its config.toml, metrics or checkpoints), and a fresh run would "
        f"overwrite them. Continue it with `shardwise train --out {out} --resume`, start a new run "
        f"with another --out, or pass --overwrite to move the old run aside to {out.name}.old-<time> "
        "(nothing is deleted)."
    )


def _same_job(out: Path, cfg: RunConfig) -> bool:
    """True when ``out``'s config.toml is ``cfg`` itself (the same job, started again)."""
    try:
        saved = tomllib.loads((out / "config.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return saved == tomllib.loads(to_toml(cfg))


def check_fresh_or_continuing(out: Path, cfg: RunConfig) -> None:
    """Raise unless this job may write into ``out``: it holds no run, or the job continues that run."""
    # defers torch
    from shardwise.runtime.checkpoint.locate import complete_checkpoints, latest_checkpoint, missing_latest_error

    if not holds_run(out):
        return
    resume = cfg.checkpoint.resume
    root = out / CHECKPOINTS_DIR
    if resume == "latest":
        return  # continues this run (its checkpoint was checked before)
    if resume == "auto":
        # A damaged pointer or newest checkpoint raises its own message (what is wrong, what to resume).
        if latest_checkpoint(root) is not None:
            return
        complete = complete_checkpoints(root)
        if complete:
            raise missing_latest_error(root, complete, 'checkpoint.resume = "auto"')
        if _same_job(out, cfg):
            return  # the same job, restarted before its first checkpoint
        raise _holds_run_error(out)
    if resume and _inside(resume, out):
        return  # resumes from one of this run's own checkpoints
    raise _holds_run_error(out)


def _inside(path: str, directory: Path) -> bool:
    return real_path(path).is_relative_to(real_path(directory))


def lock_run_dir(out: str | os.PathLike, job_id: str, command: str = "shardwise train") -> RunLock:
    """Create the run directory ``out`` if needed and lock it for this job; return the held lock.

    Raises ConfigError when ``out`` is unusable or another live job holds it. Take it before
    reading anything in ``out`` (a resume checkpoint, its config), so nothing races a live run.
    """
    return RunLock(check_out_dir(out), job_id, command).acquire()


def admit_run(lock: RunLock, cfg: RunConfig, *, overwrite: bool = False) -> None:
    """Let this job write into the locked run directory, or raise (see ``check_fresh_or_continuing``).

    With ``overwrite`` a run already there is moved aside first. A joined lock (another node of
    this job set the directory up) is let in as it is.
    """
    if lock.joined:
        return
    path = lock.run_dir
    if overwrite and holds_run(path):
        if cfg.checkpoint.resume not in ("", "auto", "latest") and _inside(cfg.checkpoint.resume, path):
            raise ConfigError(f"--overwrite would move the checkpoint you resume from ({cfg.checkpoint.resume}) "
                              f"aside with the old run in {path}; resume into another --out instead.")
        aside = move_run_aside(path)
        print(f"shardwise: --overwrite moved the run already in {path} to {aside} (nothing deleted).",
              file=sys.stderr, flush=True)
    else:
        check_fresh_or_continuing(path, cfg)


def claim_run_dir(out: str | os.PathLike, cfg: RunConfig, *, job_id: str, overwrite: bool = False,
                  command: str = "shardwise train") -> RunLock:
    """``lock_run_dir`` then ``admit_run``: the held lock of a run directory this job may write into."""
    lock = lock_run_dir(out, job_id, command)
    try:
        admit_run(lock, cfg, overwrite=overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def check_claim(out: str | os.PathLike, cfg: RunConfig, *, overwrite: bool = False,
                only_lock: bool = False) -> str:
    """What ``claim_run_dir`` would find in ``out``, without creating or locking anything (dry runs).

    Raises the same errors ``claim_run_dir`` would (``only_lock``: those of ``lock_run_dir``);
    returns a few words on what the run would do.
    """
    text = os.fspath(out)
    check_text("--out", text, kind="path")
    path = Path(text)
    if not path.exists():
        return "a new run directory"
    if not path.is_dir():
        raise ConfigError(f"--out {text!r} is an existing file, not a directory; choose a directory "
                          "for the run (it is created if missing).")
    RunLock(path, job_id="").check()
    if only_lock:
        return "unlocked"
    if overwrite and holds_run(path):
        return "the run there would be moved aside first"
    check_fresh_or_continuing(path, cfg)
    return "continuing the run there" if holds_run(path) else "an existing directory without a run"


def clear_launch_reports(out: Path) -> None:
    """Remove heartbeats and hang/failure reports of earlier launches (they must not be blamed on this one)."""
    stale = [*out.glob("hang-rank*.json"), *out.glob("failure-rank*.json"), *(out / "heartbeat").glob("*")]
    for path in stale:
        if path.is_file() or path.is_symlink():
            path.unlink(missing_ok=True)
