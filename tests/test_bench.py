import json
import subprocess
import sys

from shardwise.bench import markdown_table, row_from_summary, write_outputs
from shardwise.testing import run_command


def test_rows_table_and_files(tmp_path):
    summary = {"world_size": 2, "tokens_per_s": 1234.5, "step_time_s": 0.1, "final_train_loss": 2.5,
               "final_val_loss": 2.6, "wall_s": 10.0,
               "memory": {"ranks": [{"param_bytes": 2**20, "grad_bytes": 2**20, "optim_bytes": 2**21,
                                     "peak_bytes": 3 * 2**20},
                                    {"param_bytes": 2**20, "grad_bytes": 2**20, "optim_bytes": 2**21,
                                     "peak_bytes": 5 * 2**20}]}}
    rows = [row_from_summary("ddp", summary, "ok"), row_from_summary("fsdp", None, "failed (1)")]
    assert rows[0]["peak_mib_per_rank"] == 5.0 and rows[0]["model_state_mib_per_rank"] == 4.0
    assert (rows[0]["param_mib_per_rank"], rows[0]["grad_mib_per_rank"], rows[0]["optim_mib_per_rank"]) == (1, 1, 2)
    table = markdown_table(rows)
    assert "| ddp | 2 | ok | 1,234.5 |" in table and "failed (1)" in table
    paths = write_outputs(rows, tmp_path)
    assert {p.name for p in paths} >= {"bench.md", "bench.csv", "bench.json"}
    assert json.loads((tmp_path / "bench.json").read_text())[1]["status"] == "failed (1)"


def test_bench_runs_strategies_end_to_end(cli_env, tmp_path):
    proc = run_command([sys.executable, "-m", "shardwise", "bench", "--strategies", "single,ddp",
                        "--nproc", "2", "--steps", "3", "--out", str(tmp_path),
                        "--set", "model.preset=nano", "--set", "train.eval_batches=2"],
                       env=cli_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["strategy"] for r in rows] == ["single", "ddp"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "bench.png").is_file()


def test_bench_refuses_unknown_strategy_before_running(cli_env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardwise", "bench", "--strategies", "ddp,fdsp",
                           "--out", str(tmp_path)], env=cli_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown strategy 'fdsp'" in proc.stderr
    assert not (tmp_path / "ddp").exists()
