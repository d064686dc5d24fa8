"""A resumed run is the same run: ``train --resume`` starts from the run's own ``config.toml``.

The run directory of the checkpoint being resumed holds the resolved configuration the run
trained with. A resume keeps every one of its settings the user does not state on the command
line (``--set``, ``--strategy``, ``--nproc``); a recipe or TOML named beside ``--resume`` does not
silently replace them (its differing values are listed and ignored). The layout may change: when
the saved degrees cannot run on the new rank count and the user stated none, the layout is chosen
afresh. What alters the optimisation -- lr, schedule, global batch, seed, data, the model -- changes
only when stated on the command line; a global batch that a new layout would change is kept by
adjusting ``train.grad_accum_steps``, or the resume is refused with the list of what differs.

Every change is reported in one line before any rank starts.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.core.config import apply_overrides, from_dict, load_raw, parse_override, to_dict
from shardwise.core.config_version import upgrade
from shardwise.core.run_files import CHECKPOINTS_DIR
from shardwise.errors import CheckpointError, ConfigError, ShardwiseError
from shardwise.preflight import resolve_config

# Settings whose change alters the optimisation: they change only when stated on the command line.
OPTIMISATION_KEYS = ("train.lr", "train.min_lr", "train.warmup_steps", "train.steps", "train.weight_decay",
                     "train.betas", "train.grad_clip", "train.seed", "train.micro_batch_size",
                     "train.grad_accum_steps")
OPTIMISATION_SECTIONS = ("data.", "model.", "lora.")
# data keys that do not change what is trained on
_DATA_PLUMBING = ("data.num_workers", "data.cache_dir")
# The degrees and names that make the layout; a resume may change them.
LAYOUT_KEYS = ("parallel.strategy", "parallel.dp", "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp",
               "parallel.pp", "parallel.cp", "parallel.ep", "parallel.hsdp_shard_size", "parallel.nproc",
               "parallel.pp_microbatches", "parallel.pp_stages_per_rank", "parallel.pp_first_stage_fewer",
               "parallel.sequence_parallel")
# What names code to run (module:function factories).
_CODE_KEYS = ("model.factory", "data.factory")
# Per-invocation values that never carry over from the saved run.
_NOT_CARRIED = ("out_dir", "checkpoint.resume")


def alters_optimisation(key: str) -> bool:
    """Whether a change of config key ``key`` changes what the optimiser computes."""
    if key in _DATA_PLUMBING:
        return False
    return key in OPTIMISATION_KEYS or key.startswith(OPTIMISATION_SECTIONS)


def flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (model.overrides flattened too)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else f"{value:g}"
    return text if len(text) <= 40 else text[:37] + "..."


def find_run_config(resume: str, out: str | None) -> Path | None:
    """The ``config.toml`` of the run that ``--resume`` continues, or None when there is none.

    ``--resume`` alone continues the run in ``--out``; a path may be a run directory, its
    ``checkpoints/`` folder or one ``step-N`` checkpoint in it.
    """
    if resume in ("latest", "auto"):
        if not out:
            return None
        saved = Path(out) / "config.toml"
        return saved if saved.is_file() else None
    p = Path(resume)
    candidates = [p]
    if p.name == CHECKPOINTS_DIR:
        candidates.append(p.parent)
    elif p.parent.name == CHECKPOINTS_DIR:
        candidates.append(p.parent.parent)
    for c in candidates:
        if (c / "config.toml").is_file() and not (c / "config.toml").is_symlink():
            return c / "config.toml"
    return None


def _saved_global_batch(resume: str, out: str | None, saved_cfg: Any) -> int | None:
    """The global batch the checkpoint was trained with (its manifest), else the saved config's."""
    from shardwise.runtime.checkpoint.locate import resolve_checkpoint  # defers torch
    from shardwise.runtime.checkpoint.manifest import read_manifest  # defers torch

    source = Path(out) / CHECKPOINTS_DIR if resume in ("latest", "auto") and out else Path(resume)
    try:
        state = read_manifest(resolve_checkpoint(source)).get("state", {})
        if isinstance(state.get("global_batch"), int):
            return int(state["global_batch"])
    except (CheckpointError, OSError):
        pass  # the launch's own preflight words a missing or damaged checkpoint
    try:
        _, layout = resolve_config(saved_cfg, saved_cfg.parallel.nproc or 1)
    except ShardwiseError:
        return None
    t = saved_cfg.train
    return t.micro_batch_size * t.grad_accum_steps * layout.dp_coords(0)[1]


@dataclass
class ResumePlan:
    """What a resume takes from the saved run and what it changes (``describe`` is the one line)."""

    source: Path
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (run's, now)
    ignored: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (run's, recipe's)
    recipe: str = ""
    why: dict[str, str] = field(default_factory=dict)  # key -> why it changed without being stated

    def describe(self) -> str:
        def item(key: str) -> str:
            was, now = self.changed[key]
            why = f" ({self.why[key]})" if key in self.why else ""
            return f"{key} {_show(was)} -> {_show(now)}{why}"

        line = f"resume: the run's settings from {self.source}"
        line += "; changed: " + ", ".join(item(k) for k in self.changed) if self.changed else "; nothing changed"
        if self.ignored:
            line += (f"; kept the run's values over {self.recipe}'s: "
                     + ", ".join(f"{k} {_show(r)} (not {_show(v)})" for k, (r, v) in self.ignored.items())
                     + " (state a change with --set)")
        return line


def _user_keys(overrides: list[str]) -> dict[str, Any]:
    return dict(parse_override(o) for o in overrides)


def plan_resume(args: argparse.Namespace, overrides: list[str], world_size: int | None = None) -> ResumePlan | None:
    """Point ``args`` at the run's saved config and return what the resume keeps and changes.

    ``overrides``: the user's ``--set`` items (``--strategy`` included). Sets ``args.recipe`` to the
    saved ``config.toml`` and ``args.overrides`` to what the resume applies on top. None (``args``
    untouched) when the checkpoint has no run directory with a ``config.toml``.
    """
    from shardwise.device import default_nproc  # defers torch

    saved_path = find_run_config(args.resume, args.out)
    if saved_path is None:
        return None
    try:
        saved_raw = upgrade(tomllib.loads(saved_path.read_text(encoding="utf-8")), str(saved_path))
        saved_cfg = from_dict(copy.deepcopy(saved_raw))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ShardwiseError) as e:
        raise ConfigError(f"--resume: the run's configuration {saved_path} cannot be read ({e}); pass the "
                          "run's recipe or TOML and its --set values again.") from None
    saved = flatten(to_dict(saved_cfg))
    user = _user_keys(overrides)
    plan = ResumePlan(saved_path)
    if args.recipe and Path(args.recipe).resolve() != saved_path.resolve():
        plan.recipe = args.recipe
        for key, value in flatten(load_raw(args.recipe)).items():
            if key in user or key in _NOT_CARRIED or key == "name" or key not in saved:
                continue
            if not _same(saved[key], value):
                plan.ignored[key] = (saved[key], value)
    extra = [f"out_dir={json.dumps('' if args.resume not in ('latest', 'auto') else saved.get('out_dir', ''))}"]
    if plan.recipe:
        # Code runs only from what the user names: with a recipe given, its factories, never ones
        # a (perhaps someone else's) run directory names.
        mine = flatten(load_raw(args.recipe))
        extra += [f"{k}={json.dumps(mine.get(k, ''))}" for k in _CODE_KEYS if k not in user]
        for k in _CODE_KEYS:
            plan.ignored.pop(k, None)

    def build(more: list[str]) -> Any:
        raw = apply_overrides(copy.deepcopy(saved_raw), [*extra, *more, *overrides])
        return from_dict(raw)

    nproc = args.nproc or user.get("parallel.nproc") or saved_cfg.parallel.nproc or default_nproc()
    world = world_size or nproc * int(str(getattr(args, "nnodes", None) or 1).split(":")[0])
    cfg = build([])
    try:
        cfg, layout = resolve_config(cfg, world, ranks_per_node=nproc)
    except ShardwiseError:
        if any(k in user for k in LAYOUT_KEYS if k != "parallel.nproc"):
            raise
        # The run's degrees do not fit the new rank count and the user named none: choose afresh.
        defaults = flatten(to_dict(from_dict({})))
        extra += [f"{k}={json.dumps(defaults[k])}" for k in LAYOUT_KEYS if k != "parallel.nproc"]
        cfg, layout = resolve_config(build([]), world, ranks_per_node=nproc)
    replicas = layout.dp_coords(0)[1]
    want = _saved_global_batch(args.resume, args.out, saved_cfg)
    t = cfg.train
    now = t.micro_batch_size * t.grad_accum_steps * replicas
    if want is not None and now != want:
        stated = [k for k in ("train.micro_batch_size", "train.grad_accum_steps") if k in user]
        if not stated and want % (t.micro_batch_size * replicas) == 0:
            accum = want // (t.micro_batch_size * replicas)
            extra.append(f"train.grad_accum_steps={accum}")
            plan.why["train.grad_accum_steps"] = f"keeps the global batch {want} on {replicas} replica(s)"
            cfg, layout = resolve_config(build([]), world, ranks_per_node=nproc)
        elif not stated:
            raise ConfigError(
                f"--resume: the run trained with a global batch of {want} sequences per step, and "
                f"{world} rank(s) as {layout.strategy} ({replicas} data-parallel replica(s)) x "
                f"train.micro_batch_size={t.micro_batch_size} cannot make it (no whole "
                f"train.grad_accum_steps does). A resume keeps the optimisation; state the new batch with "
                f"--set train.micro_batch_size=N and/or --set train.grad_accum_steps=N, or choose a rank "
                f"count whose replicas x micro-batch divide {want}.")
    plan.changed = {k: (saved.get(k), v) for k, v in flatten(to_dict(cfg)).items()
                    if k not in _NOT_CARRIED and not _same(saved.get(k), v)}
    if layout.strategy != saved_cfg.parallel.strategy and "parallel.strategy" not in plan.changed:
        plan.changed["parallel.strategy"] = (saved_cfg.parallel.strategy, layout.strategy)
    if args.nproc and args.nproc != saved_cfg.parallel.nproc:
        plan.changed["parallel.nproc"] = (saved_cfg.parallel.nproc, args.nproc)
    def stated(key: str) -> bool:  # the key itself, or a section or dict above it (model.overrides={...})
        parts = key.split(".")
        return any(".".join(parts[:i]) in user for i in range(1, len(parts) + 1))

    unstated = [k for k in plan.changed if alters_optimisation(k) and not stated(k) and k not in plan.why]
    if unstated:  # every path above states or explains its changes: this guards against a new one
        raise ConfigError(f"--resume would change {', '.join(unstated)} without it being stated; state it "
                          "with --set.")
    args.recipe = str(saved_path)
    args.overrides = [*extra, *overrides]
    return plan


def adopt_run_config(args: argparse.Namespace) -> ResumePlan | None:
    """``train --resume``: continue from the run's own config.toml; the plan's ``describe()`` is
    printed once the run is admitted (a refusal stays one paragraph).

    ``--strategy`` joins the user's overrides here; without a saved config nothing changes.
    """
    if args.resume is None:
        return None
    overrides = list(args.overrides)
    if getattr(args, "strategy", None):
        overrides.append(f"parallel.strategy={json.dumps(args.strategy)}")
    plan = plan_resume(args, overrides)
    if plan is None:
        if args.recipe is None and args.resume not in ("latest", "auto"):
            print(f"resume: no config.toml of a run found beside {args.resume}; the default recipe is used "
                  "(pass the run's recipe or TOML and its --set values if it trained another model).",
                  file=sys.stderr, flush=True)
        return None
    args.strategy = None  # now one of the overrides
    return plan
