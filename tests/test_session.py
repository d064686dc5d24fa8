import pytest
import torch
from torch import nn

from shardwise import Session
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.testing import run_distributed
from tests.helpers.dist import reduce_metrics


def test_metric_reductions_across_ranks():
    r0, r1 = run_distributed(reduce_metrics, 2)
    assert r0["mean"] == 1.5 and r0["sum"] == 3.0 and r0["max"] == 2.0 and r0["min"] == 1.0
    assert r0["tensor"] == [3.0, 6.0] and r1["sum"] == 3.0
    assert r0["broadcast"] == {"from": 1} == r1["broadcast"]
    assert r0["is_main"] and not r1["is_main"]
    assert r0["strategy"] == "ddp"  # auto on 2 ranks
    assert r0["init"] == r1["init"]


def test_single_process_session_without_torchrun_env(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with Session() as s:
        assert s.world_size == 1 and s.strategy_name == "single" and s.device.type in ("cpu", "cuda")
        s.print("hello")
        assert s.all_reduce(2.0, op="sum") == 2.0
    assert "hello" in capsys.readouterr().out


def test_dataparallel_is_refused_with_migration_message():
    with Session() as s, pytest.raises(ConfigError, match=r"DataParallel.*model.module.*shardwise launch"):
        s.prepare(nn.DataParallel(nn.Linear(2, 2)))


def test_prepare_repoints_optimizer_and_guards_misuse():
    with Session() as s:
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared, opt2 = s.prepare(model, opt)
        assert opt2 is opt and {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in prepared.parameters()}
        with pytest.raises(ShardwiseError, match="already called"):
            s.prepare(nn.Linear(3, 1))
    with Session() as s:
        model = nn.Linear(3, 1)
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        with pytest.raises(ShardwiseError, match="already has state"):
            s.prepare(model, opt)


def test_accumulate_marks_only_last_micro_batch_as_sync():
    with Session(grad_accum_steps=3) as s:
        s.prepare(nn.Linear(2, 2))
        flags = []
        for _ in range(6):
            with s.accumulate():
                flags.append(s.sync_gradients)
        assert flags == [False, False, True, False, False, True]


def test_bad_reduce_op():
    with Session() as s, pytest.raises(ConfigError, match="unknown reduce op"):
        s.all_reduce(1.0, op="avg")
