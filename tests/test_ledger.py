"""The memory ledger counts what each rank stores, and sharding divides it as the ZeRO stages say.

Bounds used below (N ranks, nano GPT, AdamW):
* FSDP2 pads each parameter's dim 0 to a multiple of N, so a rank's shard exceeds 1/N of the
  whole by at most one row per parameter: |fsdp - ddp / N| <= sum over params of one row's bytes
  (parameters, gradients), twice that for AdamW's two moments, plus the per-parameter ``step``
  scalars that every rank keeps whole (4 bytes each, not divided by N).
* ZeroRedundancyOptimizer gives whole parameters to ranks, so a zero1 rank's optimizer state is
  1/N of DDP's within the state of the largest parameter (2 moments + step).
"""

import json

import pytest
import torch

from shardwise.core.config import load_config
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime import ledger
from shardwise.runtime.trainer import train as train_run
from shardwise.testing import run_distributed
from tests.helpers.sharding import train_cases

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp"]


def _bounds() -> tuple[int, int, int]:
    """(one row per param in bytes, bytes of the largest param, number of params) for nano."""
    params = list(GPT(GPT_PRESETS["nano"]).parameters())
    rows = sum(p[0].numel() * p.element_size() if p.dim() else p.element_size() for p in params)
    return rows, max(p.numel() * p.element_size() for p in params), len(params)


@pytest.fixture(scope="module")
def ledgers():
    out = {}
    for n in (2, 4):
        cases = [dict(strategy=s, steps=1, global_batch=8) for s in STRATEGIES]
        ranks = run_distributed(train_cases, n, cases=cases, timeout_s=300)
        out[n] = {s: [r[i]["ledger"] for r in ranks] for i, s in enumerate(STRATEGIES)}
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_stores_one_nth_of_ddp(ledgers, n):
    rows, _, n_params = _bounds()
    ddp = ledgers[n]["ddp"][0]
    for rank_entry in ledgers[n]["fsdp"]:
        assert abs(rank_entry["param_bytes"] - ddp["param_bytes"] / n) <= rows
        assert abs(rank_entry["grad_bytes"] - ddp["grad_bytes"] / n) <= rows
        step_bytes = 4 * n_params
        assert abs(rank_entry["optim_bytes"] - ddp["optim_bytes"] / n) <= 2 * rows + step_bytes
        total = sum(rank_entry[k] for k in ledger.FIELDS)
        assert total < sum(ddp[k] for k in ledger.FIELDS) / n * 1.15


@pytest.mark.parametrize("n", [2, 4])
def test_zero1_shards_only_optimizer_state(ledgers, n):
    _, largest, _ = _bounds()
    ddp = ledgers[n]["ddp"][0]
    zero1 = ledgers[n]["zero1"]
    for entry in zero1:
        assert entry["param_bytes"] == ddp["param_bytes"]
        assert entry["grad_bytes"] == ddp["grad_bytes"]
        assert abs(entry["optim_bytes"] - ddp["optim_bytes"] / n) <= 2 * largest + 8
    # Together the ranks hold exactly DDP's state once (the step counters included).
    assert sum(e["optim_bytes"] for e in zero1) == ddp["optim_bytes"]


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_shards_gradients_and_optimizer_state(ledgers, n):
    rows, _, n_params = _bounds()
    ddp = ledgers[n]["ddp"][0]
    for entry in ledgers[n]["zero2"]:
        got = entry["grad_bytes"] + entry["optim_bytes"]
        want = (ddp["grad_bytes"] + ddp["optim_bytes"]) / n
        assert abs(got - want) <= 3 * rows + 4 * n_params


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(10, 4)
    assert ledger.storage_bytes([base, base[:5], base[5:]]) == 160
    assert ledger.storage_bytes([torch.zeros(3), torch.zeros(0)]) == 12


def test_summary_json_carries_the_ledger(tmp_path, capsys):
    cfg = load_config(None, ["model.preset=nano", "train.steps=2", "train.eval_batches=1",
                             "train.sample_tokens=0", "train.progress=false", "train.micro_batch_size=4",
                             "checkpoint.at_end=false", "parallel.strategy=single"])
    train_run(cfg, tmp_path)
    memory = json.loads((tmp_path / "summary.json").read_text())["memory"]
    (entry,) = memory["ranks"]
    assert entry["coords"] == {"dp": 0}  # where this rank sits in the layout's mesh
    n_bytes = sum(p.numel() * 4 for p in GPT(GPT_PRESETS["nano"]).parameters())
    assert entry["param_bytes"] == entry["grad_bytes"] == n_bytes
    assert entry["optim_bytes"] >= 2 * n_bytes  # AdamW: two moments + step counters
    assert entry["peak_bytes"] > 0 and entry["peak_source"]
    assert "params_MiB" in ledger.format_table(memory)
    # The planner's prediction for this very run sits next to the measurement, and is exact here.
    predicted = entry["predicted"]
    assert {k: predicted[k] for k in ledger.FIELDS} == {k: entry[k] for k in ledger.FIELDS}
    assert predicted["activation_bytes"] > 0 and predicted["peak_bytes"] > sum(entry[k] for k in ledger.FIELDS)
    assert memory["prediction"]["model"] == "gpt-nano" and memory["prediction"]["micro_batch"] == 4
    (row,) = memory["predicted_vs_measured"]
    assert row["param_bytes"]["diff_bytes"] == 0 and "peak_bytes" not in row  # CPU peak is RSS: not compared
    err = capsys.readouterr().err
    assert "planner prediction vs measured" in err and "peak not compared" in err
