"""[log] trackers: each one writes what its own library reads back; a missing extra fails up front."""

import csv
import json
import struct
import subprocess
import sys
import zlib

import pytest

from shardwise.core.config import load_config
from shardwise.errors import ConfigError
from shardwise.observe.trackers import CsvTracker, check_trackers
from shardwise.runtime.trainer import train


def read_wandb_records(path):
    """Records of a ``.wandb`` transaction log, parsed with wandb's own protobuf schema.

    The file is W&B's LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks (crc32, length, type: full/first/middle/last), each record one protobuf.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # block trailer too short for a chunk header
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.fixture
def clean_tracker_env(monkeypatch):
    # The defaults under test: W&B offline, MLflow's file store in the run directory.
    for key in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "WANDB_DIR"):
        monkeypatch.setenv(key, "placeholder")  # recorded, so the test's own changes are undone
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_one_run_feeds_all_four_trackers(tmp_path, clean_tracker_env):
    run = tmp_path / "run"
    cfg = load_config(None, ["model.preset=nano", "train.steps=3", "train.log_every=1", "train.eval_every=0",
                             "train.eval_batches=2", "train.sample_tokens=0", "train.progress=false",
                             "checkpoint.at_end=false", "parallel.strategy=single", "train.lr=0.002",
                             'log.trackers=["tensorboard", "wandb", "mlflow", "csv"]', "log.project=tracktest"])
    summary = train(cfg, run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == [1, 2, 3]

    # TensorBoard: scalars and the config, through tensorboard's own event reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    assert {e.step: e.value for e in ea.Scalars("loss")} == pytest.approx(losses)
    assert [e.step for e in ea.Scalars("val_loss")] == [3]
    config_text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lr = 0.002" in config_text and "[log]" in config_text
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    start = HParamsPluginData.FromString(ea.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["train.lr"].number_value == 0.002 and hparams["model.preset"].string_value == "nano"
    assert ea.Scalars("hparam/final_val_loss")[0].value == pytest.approx(summary["final_val_loss"])

    # W&B: the offline run's .wandb log holds the config and every history row.
    (wandb_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records_wb = read_wandb_records(wandb_file)
    run_record = next(r.run for r in records_wb if r.WhichOneof("record_type") == "run")
    assert run_record.project == "tracktest" and run_record.display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["train"]["lr"] == 0.002 and config["model"]["preset"] == "nano"
    history = {}
    for r in records_wb:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert {step: row["loss"] for step, row in history.items() if "loss" in row} == pytest.approx(losses)

    # MLflow: the file store in the run directory, through MLflow's client.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (ml_run,) = client.search_runs([client.get_experiment_by_name("tracktest").experiment_id])
    assert ml_run.info.status == "FINISHED" and ml_run.info.run_name == "run"
    assert ml_run.data.params["train.lr"] == "0.002" and ml_run.data.params["model.preset"] == "nano"
    history = client.get_metric_history(ml_run.info.run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses)
    assert ml_run.data.metrics["final_val_loss"] == pytest.approx(summary["final_val_loss"])

    # CSV: one row per record, the same numbers.
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["step"]): float(r["loss"]) for r in rows if r["loss"]} == pytest.approx(losses)
    assert [float(r["val_loss"]) for r in rows if r["val_loss"]] == pytest.approx([summary["final_val_loss"]])


def test_csv_tracker_widens_its_header_and_continues_after_resume(tmp_path):
    t = CsvTracker(tmp_path)
    t.log({"step": 1, "loss": 2.0})
    t.log({"step": 2, "loss": 1.5})
    t.log({"step": 2, "val_loss": 1.7})  # a new column rewrites the file with the wider header
    t.log({"step": 3, "loss": 1.2})
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["loss"], r["val_loss"]) for r in rows] == [
        ("1", "2.0", ""), ("2", "1.5", ""), ("2", "", "1.7"), ("3", "1.2", "")]
    # A run resumed from step 2 trains step 3 again: its old row goes, the rest stays.
    t2 = CsvTracker(tmp_path, start_step=2)
    t2.log({"step": 3, "loss": 1.1})
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "2.0"), ("2", "1.5"), ("2", ""), ("3", "1.1")]


def test_missing_extra_is_a_clear_error_before_any_rank_starts(tmp_path, cli_env, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'shardwise\[mlflow\]'"):
        check_trackers(["csv", "mlflow"])
    monkeypatch.undo()
    # Through the CLI, as a user without wandb installed sees it (sys.modules[name] = None is how
    # Python marks a module that cannot be imported).
    out = tmp_path / "run"
    code = ("import sys; sys.modules['wandb'] = None; from shardwise.cli import main; "
            f"sys.exit(main(['train', '--nproc', '2', '--out', {str(out)!r}, '--set', 'log.trackers=csv,wandb']))")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "log.trackers lists 'wandb' but the 'wandb' package is not installed: pip install 'shardwise[wandb]'" \
        in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before any rank started or wrote anything


def test_tracker_config_is_validated():
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'. Did you mean 'tensorboard'"):
        load_config(None, ["log.trackers=tensorbord"])
    with pytest.raises(ConfigError, match="log.wandb_mode"):
        load_config(None, ["log.wandb_mode=cloud"])
