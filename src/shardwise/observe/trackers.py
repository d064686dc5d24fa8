"""``[log] trackers``: TensorBoard, Weights & Biases, MLflow and CSV, fed by rank 0.

Each tracker receives exactly the records that go to ``metrics.jsonl`` (which stays the
always-on record), with the record's ``step`` as the x-axis, and the run's resolved config as its
hyper-parameters. The libraries are optional extras, imported only when a tracker is asked for;
``check_trackers`` runs before any rank starts and names the ``pip install 'shardwise[...]'`` line
for a missing one.

Where each one writes (all inside the run directory unless the user points elsewhere):

==============  ===============================================================================
tensorboard     ``<run>/tensorboard/``: event files (``tensorboard --logdir <run>/tensorboard``);
                scalars per metric, the config as text and as HParams
wandb           ``<run>/wandb/offline-run-*/``: offline unless ``log.wandb_mode`` (or the user's
                ``WANDB_MODE``) says online; ``wandb sync`` uploads it later
mlflow          ``<run>/mlruns/``: a local file store, unless ``log.mlflow_tracking_uri`` (or the
                user's ``MLFLOW_TRACKING_URI``) names a server; ``mlflow ui --backend-store-uri``
csv             ``<run>/metrics.csv``: one row per record, one column per metric
==============  ===============================================================================
"""

from __future__ import annotations

import csv
import importlib.util
import io
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardwise.core.config import TRACKERS, LogConfig, RunConfig, to_dict
from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_text

# tracker -> (module that must import, pip extra that installs it)
REQUIREMENTS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                "mlflow": ("mlflow", "mlflow"), "csv": (None, None)}


def check_trackers(names: Iterable[str]) -> None:
    """Raise ConfigError naming the pip extra for every asked-for tracker whose library is missing."""
    missing = []
    for name in names:
        if name not in REQUIREMENTS:
            raise ConfigError(f"unknown tracker {name!r}. Valid trackers: {', '.join(TRACKERS)}.")
        module, extra = REQUIREMENTS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            missing.append((name, module, extra))
    if missing:
        lines = "; ".join(f"log.trackers lists {name!r} but the {module!r} package is not installed: "
                          f"pip install 'shardwise[{extra}]'" for name, module, extra in missing)
        raise ConfigError(f"{lines}. Or remove it from log.trackers.")


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as flat ``section.key`` -> scalar hyper-parameters (lists as strings)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and prefix.count(".") < 1:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (bool, int, float, str)):
            out[prefix] = value
        else:
            out[prefix] = str(value)  # lists, tuples, model.overrides

    walk("", to_dict(cfg))
    return out


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    # Trackers plot numbers; None (a NaN in metrics.jsonl) and text are left out.
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker:
    """One experiment tracker: ``log(record)`` per logged record, ``close(summary)`` at the end."""

    name = ""

    def log(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path, cfg: RunConfig, toml: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # defers torch

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.hparams = flat_config(cfg)
        # Text in markdown: indenting by 4 spaces keeps TOML's layout in TensorBoard's text tab.
        self.writer.add_text("config", "\n".join("    " + line for line in toml.splitlines()), 0)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in _numeric(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        final = _numeric({k: (summary or {}).get(k) for k in
                          ("final_train_loss", "final_val_loss", "tokens_per_s", "step_time_s")})
        # HParams dashboard: the config beside the final figures, in this same log dir.
        self.writer.add_hparams(self.hparams, {f"hparam/{k}": v for k, v in final.items()}, run_name=".")
        self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run_dir: Path, cfg: RunConfig, log_cfg: LogConfig) -> None:
        import wandb  # defers wandb (optional)

        # Offline unless the user chose otherwise (in the config, or the WANDB_MODE they set).
        mode = log_cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        settings: dict[str, Any] = {"silent": True, "console": "off"}
        if "x_disable_stats" in getattr(wandb.Settings, "model_fields", {}):
            # System metrics would start a sampler process per run; training metrics are the point.
            settings["x_disable_stats"] = True
        self.run = wandb.init(project=log_cfg.project or cfg.name, name=run_dir.name, dir=str(run_dir),
                              mode=mode, config=to_dict(cfg), settings=wandb.Settings(**settings))

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_numeric(record), step=int(record.get("step", 0)))

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        for key, value in (summary or {}).items():
            if isinstance(value, (int, float, str, bool)) or value is None:
                self.run.summary[key] = value
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker(Tracker):
    name = "mlflow"
    MAX_BATCH = 100  # MLflow's limit on params (and metrics: 1000) per log_batch call

    def __init__(self, run_dir: Path, cfg: RunConfig, log_cfg: LogConfig) -> None:
        from mlflow.tracking import MlflowClient  # defers mlflow (optional)

        uri = log_cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store behind an opt-in (it recommends a database, which
            # mlflow-skinny cannot run); a store private to this run directory is what we want.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment_name = log_cfg.project or cfg.name
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(experiment_name))
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        from mlflow.entities import Param  # defers mlflow (optional)

        # Long values (model.overrides of a big custom model) are cut to MLflow's oldest limit.
        params = [Param(k, str(v)[:500]) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), self.MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_BATCH])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric  # defers mlflow (optional)

        now_ms = int(time.time() * 1000)
        step = int(record.get("step", 0))
        metrics = [Metric(k, v, now_ms, step) for k, v in _numeric(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        from mlflow.entities import Metric  # defers mlflow (optional)

        final = _numeric({k: v for k, v in (summary or {}).items() if k.startswith("final_")
                          or k in ("tokens_per_s", "step_time_s", "wall_s")})
        now_ms, step = int(time.time() * 1000), int((summary or {}).get("steps") or 0)
        if final:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in final.items()])
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class CsvTracker(Tracker):
    """``metrics.csv``: a wide table; a record with a new metric rewrites the file with the wider header."""

    name = "csv"

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        self.path = run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        if start_step > 0 and self.path.is_file():
            # A resumed run continues the file, without the rows of steps it will train again.
            with open(self.path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = [r for r in reader if r.get("step", "").isdigit() and int(r["step"]) <= start_step]
        self._rewrite()

    def _rewrite(self) -> None:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.columns, restval="")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.path, buf.getvalue())

    def log(self, record: dict[str, Any]) -> None:
        row = {k: ("" if v is None else v) for k, v in record.items()}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self.columns, restval="").writerow(row)

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        pass  # every row is on disk as soon as it is logged


def open_trackers(log_cfg: LogConfig, cfg: RunConfig, run_dir: str | Path, toml: str,
                  start_step: int = 0) -> list[Tracker]:
    """Start every tracker named in ``log_cfg.trackers`` for the run in ``run_dir`` (rank 0 only)."""
    check_trackers(log_cfg.trackers)
    run_dir = Path(run_dir)
    opened: list[Tracker] = []
    try:
        for name in log_cfg.trackers:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(run_dir, cfg, toml))
            elif name == "wandb":
                opened.append(WandbTracker(run_dir, cfg, log_cfg))
            elif name == "mlflow":
                opened.append(MlflowTracker(run_dir, cfg, log_cfg))
            else:
                opened.append(CsvTracker(run_dir, start_step))
    except BaseException:
        for tracker in opened:  # do not leave a half-started W&B/MLflow run behind
            tracker.close(None, failed=True)
        raise
    return opened
