"""The DeepSpeed config of a run: built for ``zero3-offload``/``zero3-nvme``, or the user's file.

A user's ``ds_config.json`` may say ``"auto"`` for any value shardwise already knows, as with
Accelerate and transformers' Trainer; each is filled from the run (``FILLS`` below). A value the
file states explicitly must agree with shardwise's: a file saying ``gradient_accumulation_steps: 4``
for a run with ``train.grad_accum_steps = 2`` is an error naming both, never a silent override.

Kept out of the file (errors): a ``scheduler`` section (shardwise's learning-rate schedule, or the
scheduler passed to ``Session.prepare``, drives the optimizer's lr) and ``zero_optimization.stage``
values other than 0..3.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class RunValues:
    """What shardwise knows about the run, to fill ``"auto"`` and check explicit values.

    ``micro_batch_size`` None: not known yet (a user loop that makes its loader after prepare).
    """

    grad_accum_steps: int
    dp_size: int
    precision: str
    micro_batch_size: int | None = None
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    nvme_path: str = ""


def _offload(device: str, nvme_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def builtin_config(strategy: str, values: RunValues) -> dict[str, Any]:
    """The config of the built-in kinds: ZeRO-3 with parameters and optimizer state offloaded."""
    device = "nvme" if strategy == "zero3-nvme" else "cpu"
    cfg: dict[str, Any] = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": _offload(device, values.nvme_path),
            "offload_optimizer": _offload(device, values.nvme_path),
        },
    }
    if device == "nvme":
        # DeepSpeed's documented defaults for ZeRO-Infinity's async I/O.
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                      "overlap_events": True, "thread_count": 1}
    return fill(cfg, values, source=f"strategy {strategy}")


def read_user_config(path: str) -> dict[str, Any]:
    """Read a user's ``ds_config.json``; ConfigError for a missing or malformed file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"parallel.deepspeed_config = {path!r} is not a file; name your DeepSpeed JSON config "
                          "(e.g. ds_config.json), or choose strategy zero3-offload / zero3-nvme.")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"parallel.deepspeed_config {path!r} is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"parallel.deepspeed_config {path!r} holds a {type(data).__name__}, not a JSON object.")
    return data


def _check(cfg: dict[str, Any], key: str, ours: Any, what: str, source: str) -> None:
    """Fill ``cfg[key]`` with ``ours`` when missing/"auto"; refuse an explicit different value."""
    value = cfg.get(key, AUTO)
    if value == AUTO or value is None:
        if ours is not None:
            cfg[key] = ours
        else:
            cfg.pop(key, None)
        return
    if ours is None:
        return
    same = (abs(float(value) - float(ours)) <= 1e-12 * max(1.0, abs(float(ours)))
            if isinstance(ours, float) and isinstance(value, (int, float)) else value == ours)
    if isinstance(ours, tuple):
        same = list(value) == list(ours)
    if not same:
        raise ConfigError(f"{source} sets {key} = {value!r}, but shardwise's {what} is {ours!r}. Set it to "
                          f"\"auto\" (or remove it) to take shardwise's value, or change {what} to match.")


def fill(cfg: dict[str, Any], values: RunValues, *, source: str) -> dict[str, Any]:
    """Return a copy of ``cfg`` with every "auto" filled and every explicit value checked."""
    cfg = copy.deepcopy(cfg)
    if "scheduler" in cfg:
        raise ConfigError(f"{source} has a \"scheduler\" section; shardwise drives the learning rate itself "
                          "(train.lr / warmup_steps / min_lr, or the scheduler you pass to Session.prepare). "
                          "Remove the section.")
    _check(cfg, "gradient_accumulation_steps", values.grad_accum_steps, "train.grad_accum_steps", source)
    _check(cfg, "train_micro_batch_size_per_gpu", values.micro_batch_size, "train.micro_batch_size", source)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if micro is None:
        # A user loop whose loader comes later: DeepSpeed needs a number, only for its logs.
        micro = cfg["train_micro_batch_size_per_gpu"] = 1
    _check(cfg, "train_batch_size", micro * values.grad_accum_steps * values.dp_size,
           "global batch (micro_batch_size x grad_accum_steps x data-parallel ranks)", source)
    # Clipping comes from Session.step(max_norm=...) each step; an explicit value is checked there.
    if cfg.get("gradient_clipping", AUTO) == AUTO:
        cfg["gradient_clipping"] = 0.0
    _fill_precision(cfg, values.precision, source)
    opt = cfg.get("optimizer")
    if isinstance(opt, dict):
        params = opt.setdefault("params", {})
        _check(params, "lr", values.lr, "train.lr", f"{source} optimizer.params")
        _check(params, "betas", values.betas, "train.betas", f"{source} optimizer.params")
        _check(params, "eps", values.eps, "the optimizer's eps", f"{source} optimizer.params")
        _check(params, "weight_decay", values.weight_decay, "train.weight_decay", f"{source} optimizer.params")
    zero = cfg.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{source} sets zero_optimization.stage = {stage!r}; DeepSpeed has stages 0, 1, 2 and 3.")
    # Bucket sizes: "auto" means DeepSpeed's own default (transformers derives them from the
    # hidden size; shardwise does not assume one for an arbitrary module).
    for key in [k for k, v in zero.items() if v == AUTO]:
        del zero[key]
    for section in ("offload_param", "offload_optimizer"):
        off = zero.get(section)
        if isinstance(off, dict) and off.get("device") == "nvme":
            _check(off, "nvme_path", values.nvme_path or None, "parallel.nvme_path",
                   f"{source} zero_optimization.{section}")
            if not off.get("nvme_path"):
                raise ConfigError(f"{source} offloads {section} to NVMe but names no nvme_path; set "
                                  "parallel.nvme_path (or nvme_path in the file).")
    # Nothing printed every N steps: shardwise logs the run itself.
    cfg.setdefault("steps_per_print", 2**31 - 1)
    cfg.setdefault("wall_clock_breakdown", False)
    # The trainer's own AdamW may run on the offloaded CPU partitions (DeepSpeed otherwise demands
    # its DeepSpeedCPUAdam): the same optimizer, so the same numbers, under every strategy.
    cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    return cfg


def _fill_precision(cfg: dict[str, Any], precision: str, source: str) -> None:
    wants = {"fp16": precision == "fp16-mixed", "bf16": precision == "bf16-mixed"}
    for key, on in wants.items():
        section = cfg.get(key)
        if section is None:
            if on:
                cfg[key] = {"enabled": True}
            continue
        enabled = section.get("enabled", AUTO) if isinstance(section, dict) else section
        if enabled == AUTO:
            cfg[key] = {**(section if isinstance(section, dict) else {}), "enabled": on}
        elif bool(enabled) != on:
            raise ConfigError(f"{source} sets {key}.enabled = {enabled!r}, but shardwise's parallel.precision is "
                              f"{precision!r}. Set it to \"auto\", or set parallel.precision to match "
                              "(fp16-mixed, bf16-mixed or fp32).")


def offload_devices(cfg: dict[str, Any]) -> set[str]:
    """The offload devices a (filled) config uses: a subset of {"cpu", "nvme"}."""
    zero = cfg.get("zero_optimization") or {}
    return {str(zero[s].get("device")) for s in ("offload_param", "offload_optimizer")
            if isinstance(zero.get(s), dict) and zero[s].get("device") in ("cpu", "nvme")}


def nvme_paths(cfg: dict[str, Any]) -> list[str]:
    """Every nvme_path a (filled) config swaps to."""
    zero = cfg.get("zero_optimization") or {}
    return sorted({str(zero[s]["nvme_path"]) for s in ("offload_param", "offload_optimizer")
                   if isinstance(zero.get(s), dict) and zero[s].get("device") == "nvme"
                   and zero[s].get("nvme_path")})
