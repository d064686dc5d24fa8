import json
import subprocess
import sys

import pytest

from shardwise import bench
from shardwise.bench import aggregate, markdown_table, overheads, row_from_summary, write_outputs
from shardwise.cli import main
from shardwise.testing import run_command


def _summary(tokens_per_s, step_time_s, loss=2.5):
    return {"world_size": 2, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s, "final_train_loss": loss,
            "final_val_loss": 2.6, "wall_s": 10.0,
            "memory": {"ranks": [{"param_bytes": 2**20, "grad_bytes": 2**20, "optim_bytes": 2**21,
                                  "peak_bytes": 3 * 2**20},
                                 {"param_bytes": 2**20, "grad_bytes": 2**20, "optim_bytes": 2**21,
                                  "peak_bytes": 5 * 2**20}]}}


def test_rows_table_and_files(tmp_path):
    rows = [row_from_summary("ddp", _summary(1234.5, 0.1), "ok"), row_from_summary("fsdp", None, "failed (1)")]
    assert rows[0]["peak_mib_per_rank"] == 5.0 and rows[0]["model_state_mib_per_rank"] == 4.0
    assert (rows[0]["param_mib_per_rank"], rows[0]["grad_mib_per_rank"], rows[0]["optim_mib_per_rank"]) == (1, 1, 2)
    table = markdown_table(rows)
    assert "| ddp | shardwise | 2 | ok | 1 | 1,234.5 |" in table and "failed (1)" in table
    paths = write_outputs(rows, tmp_path)
    assert {p.name for p in paths} >= {"bench.md", "bench.csv", "bench.json"}
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][1]["status"] == "failed (1)"


def test_repeats_give_medians_spread_and_per_round_overhead():
    # Three interleaved rounds; round 2 was noisy for both (the machine, not the code).
    def pair(speed, step, ref_speed, ref_step):
        return [row_from_summary("ddp", _summary(speed, step), "ok"),
                row_from_summary("torch-ddp", _summary(ref_speed, ref_step), "ok")]

    rounds = [pair(1000, 0.20, 1100, 0.19), pair(500, 0.40, 520, 0.32), pair(1010, 0.21, 1000, 0.20)]
    rows = [aggregate(name, [rnd[i] for rnd in rounds]) for i, name in enumerate(["ddp", "torch-ddp"])]
    ddp, ref = rows
    assert ddp["tokens_per_s"] == 1000 and (ddp["tokens_per_s_min"], ddp["tokens_per_s_max"]) == (500, 1010)
    assert ddp["step_time_s"] == 0.21 and ddp["runs"] == "3" and ref["impl"] == "reference"
    (ratio,) = overheads(rows, rounds)
    assert ratio["ratio"] == pytest.approx(0.21 / 0.20)
    assert ratio["round_min"] == pytest.approx(0.21 / 0.20) and ratio["round_max"] == pytest.approx(0.40 / 0.32)
    # A failed round is reported, and its figures are not mixed into the medians.
    failed = aggregate("ddp", [rounds[0][0], row_from_summary("ddp", None, "failed (1)")])
    assert failed["status"] == "failed (1)" and failed["runs"] == "1/2" and failed["tokens_per_s"] == 1000


def test_rounds_are_interleaved(monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, env=None):
        out = __import__("pathlib").Path(cmd[cmd.index("--out") + 1])
        calls.append(out.parent.name + "/" + out.name)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(_summary(1000, 0.1)))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = bench.build_args_for_test(["--strategies", "ddp,torch-ddp", "--repeat", "2", "--steps", "2",
                                      "--out", str(tmp_path), "--set", "model.preset=nano"])
    assert bench.run(args) == 0
    assert calls == ["ddp/round1", "torch-ddp/round1", "ddp/round2", "torch-ddp/round2"]


def test_bench_with_reference_loops_end_to_end(cli_env, tmp_path):
    """ddp / fsdp against plain torch-ddp, torch-fsdp2, Accelerate and Lightning Fabric loops, one command."""
    proc = run_command([sys.executable, "-m", "shardwise", "bench", "--strategies",
                        "ddp,fsdp,torch-ddp,torch-fsdp2,accelerate,fabric", "--nproc", "2", "--steps", "2",
                        "--out", str(tmp_path),
                        "--set", "model.preset=nano", "--set", "train.eval_batches=2"],
                       env=cli_env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["strategy"]: r for r in data["rows"]}
    assert list(rows) == ["ddp", "fsdp", "torch-ddp", "torch-fsdp2", "accelerate", "fabric"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["peak_mib_per_rank"] > 0 for r in rows.values())
    assert {r["impl"] for r in rows.values()} == {"shardwise", "reference"}
    # Same model, data order, seed and schedule: the plain loops end at shardwise's loss.
    for strategy, ref in [("ddp", "torch-ddp"), ("ddp", "accelerate"), ("ddp", "fabric"), ("fsdp", "torch-fsdp2")]:
        assert rows[ref]["final_train_loss"] == pytest.approx(rows[strategy]["final_train_loss"], abs=1e-5)
        assert rows[ref]["final_val_loss"] == pytest.approx(rows[strategy]["final_val_loss"], abs=1e-5)
        # The same ledger at the same moment: sharded or not, the plain loop holds the same bytes.
        for kind in ("param", "grad", "optim"):
            assert rows[ref][f"{kind}_mib_per_rank"] == rows[strategy][f"{kind}_mib_per_rank"]
    pairs = {(p["strategy"], p["reference"]): p for p in data["overhead"]}
    assert set(pairs) == {("ddp", "torch-ddp"), ("ddp", "accelerate"), ("ddp", "fabric"), ("fsdp", "torch-fsdp2")}
    assert rows["ddp"]["overhead_vs"] == "torch-ddp"
    assert rows["ddp"]["overhead_ratio"] == pytest.approx(rows["ddp"]["step_time_s"] / rows["torch-ddp"]["step_time_s"])
    md = (tmp_path / "bench.md").read_text()
    assert "| torch-fsdp2 | reference | 2 | ok |" in md and "- fsdp / torch-fsdp2: " in md
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "torch-ddp" in (tmp_path / "bench.csv").read_text()


def test_classic_names_the_lab_table(monkeypatch):
    assert bench._parse_names("classic") == (list(bench.CLASSIC), [])
    monkeypatch.setattr(bench, "installed", lambda name: name != "accelerate")  # the name bench calls
    names, notes = bench._parse_names("classic")
    assert "accelerate" not in names
    assert notes == ["accelerate skipped: not installed (pip install 'shardwise[accelerate]')"]


def test_bench_refuses_bad_input_before_running(capsys, tmp_path):
    for argv, message in [(["--strategies", "ddp,fdsp"], "unknown strategy 'fdsp'"),
                          (["--strategies", "ddp,torch-ddp", "--set", "parallel.precision=fp16-mixed"],
                           "the reference loop 'torch-ddp' does not implement parallel.precision='fp16-mixed'"),
                          (["--strategies", "ddp,ddp"], "more than once"),
                          (["--strategies", "ddp", "--repeat", "0"], "--repeat must be between 1 and 1000")]:
        code = main(["bench", *argv, "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "ddp").exists()


def test_reference_loops_compile_blocks_when_the_run_compiles():
    from types import SimpleNamespace

    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.reference.common import compile_blocks

    model = compile_blocks(GPT(GPT_PRESETS["nano"]), SimpleNamespace(compile=True))
    assert all(type(b).__name__ == "OptimizedModule" for b in model.blocks.values())
    plain = compile_blocks(GPT(GPT_PRESETS["nano"]), SimpleNamespace(compile=False))
    assert not any(type(b).__name__ == "OptimizedModule" for b in plain.blocks.values())
