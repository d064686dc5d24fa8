"""``train --dry-run`` / ``verify --dry-run``: every check, the layout and the planner's per-rank
memory, no rank started and nothing written; training an architecture by preset name.

All in-process through ``shardwise.cli.main`` (one parse, one meta model per case: no ranks).
"""

from __future__ import annotations

import pytest

from shardwise.cli import main

NANO = ["--set", "model.preset=nano"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_train_dry_run_prints_layout_and_prediction_and_writes_nothing(capsys, tmp_path):
    out_dir = tmp_path / "run"
    code, out, err = run_main(capsys, "train", "--dry-run", "--nproc", "4", "--strategy", "fsdp+tp",
                              "--set", "parallel.tp=2", "--out", str(out_dir), *NANO)
    assert code == 0, err
    assert "no rank was started, nothing was written" in out
    assert "layout: fsdp+tp on 4 rank(s)" in out and "mesh pp=1 x dp=2 x tp=2" in out
    assert "blocks: 2 at blocks" in out
    assert "predicted memory per rank" in out and "params_MiB" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0-1", "2-3"]  # the two data-parallel shards of the TP pairs
    assert not out_dir.exists()


def test_pipeline_dry_run_shows_stages_and_microbatches(capsys):
    code, out, err = run_main(capsys, "train", "--dry-run", "--nproc", "2", "--strategy", "pp",
                              "--set", "train.micro_batch_size=8", *NANO)
    assert code == 0, err
    assert "pipeline: 1f1b, 2 stages (1 per rank), 4 microbatches per step" in out
    assert "stage layers: 0 | 1" in out
    assert "4 micro-batch(es) of 2 x 32 tokens" in out


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2", "--strategy", "pp", "--set", "train.micro_batch_size=3"],
     "per-rank batch of 3 samples (train.micro_batch_size) does not split into 4"),
    (["--nproc", "3", "--strategy", "pp", "--set", "train.micro_batch_size=6"], "exceed the model's 2 layers"),
    (["--nproc", "2", "--strategy", "tp", "--set", "model.overrides={n_head = 3, n_embd = 48}"],
     "n_head=3"),
    (["--nproc", "2", "--strategy", "ddp", "--set", "parallel.tp=2"], "is pure data parallel"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0.invalid:1"], "does not resolve"),
    (["--nproc", "2", "--nnodes", "2", "--out", "x"], "--rdzv-endpoint HOST:PORT"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--out", "x", "--rdzv-endpoint", "h:1"],
     "--node-rank must be between 0 and --nnodes - 1 = 1"),
])
def test_dry_run_refuses_what_the_ranks_would_refuse(capsys, tmp_path, argv, message):
    code, out, err = run_main(capsys, "train", "--dry-run", *argv, *NANO)
    assert code == 2 and message in err and "Traceback" not in err
    assert "dry run" not in out


def test_verify_dry_run(capsys, tmp_path):
    code, out, err = run_main(capsys, "verify", "--dry-run", "--strategy", "zero1", "--nproc", "2",
                              "--out", str(tmp_path / "v"), *NANO)
    assert code == 0, err
    assert out.startswith("dry run of `shardwise verify`") and "layout: zero1 on 2 rank(s)" in out
    assert not (tmp_path / "v").exists()


def test_train_an_architecture_by_preset_name(capsys):
    pytest.importorskip("transformers")
    code, out, err = run_main(capsys, "train", "hf-shakespeare", "--dry-run", "--nproc", "8", "--strategy", "fsdp+tp",
                              "--set", "parallel.tp=8", "--set", "model.hf_config=llama-3-70b",
                              "--set", "model.overrides.block_size=4096", "--set", "parallel.precision=bf16-mixed",
                              "--set", "train.micro_batch_size=1", "--set", "parallel.activation_checkpointing=full")
    assert code == 0, err
    # The published architecture, vocabulary included (it covers the data's 65 characters).
    assert "model: llama-3-70b, 70,553.71M parameters" in out
    assert "blocks: 80 at hf.model.layers" in out and "layout: fsdp+tp on 8 rank(s)" in out


def test_summary_json_predicts_what_the_dry_run_predicts(capsys, tmp_path):
    """Regression: the trainer called the planner without ac_every/grad_sync, so
    summary.json's prediction drifted from --dry-run's. Both make the same call now."""
    import json

    from shardwise.cli import build_parser
    from shardwise.job.train import dry_run_prediction, resolve_run

    out_dir = tmp_path / "run"
    argv = ["train", "--nproc", "1", "--out", str(out_dir), *NANO, "--set", "train.steps=2",
            "--set", "train.grad_accum_steps=2", "--set", "parallel.activation_checkpointing=selective",
            "--set", "parallel.ac_every=1", "--set", "parallel.grad_sync=microbatch"]
    predicted = dry_run_prediction(resolve_run(build_parser().parse_args(argv)))
    default_every = dry_run_prediction(resolve_run(build_parser().parse_args(argv[:-4])))
    # The knobs matter to the prediction, so a trainer that dropped them would disagree below.
    assert predicted.ranks[0].activation_bytes != default_every.ranks[0].activation_bytes
    code, _, err = run_main(capsys, *argv)
    assert code == 0, err
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["memory"]["ranks"][0]["predicted"] == predicted.ranks[0].to_dict()


def _tree(root):
    """Every path under ``root`` with its size and modification time (what a write would change)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_dry_run_leaves_the_data_cache_and_run_folder_as_they_were(capsys, tmp_path):
    """Regression: "nothing was written" was untrue: a dry run built the token cache, and left its
    .lock files even when it refused. Now it reads the cache, creates nothing there, and builds a
    missing entry in a temporary folder that it removes; accepted or refused alike."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from helpers.text import corpus_text, make_tokenizer, text_overrides

    from shardwise.core.config import load_config
    from shardwise.data.text import load_text

    tok = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "data" / "corpus.txt"
    data.parent.mkdir()
    data.write_text(corpus_text(6000), encoding="utf-8")
    cache, run = tmp_path / "cache", tmp_path / "run"
    sets = [a for o in text_overrides(data, tok, cache) for a in ("--set", o)]
    before = _tree(tmp_path)
    code, out, err = run_main(capsys, "train", "--dry-run", "--nproc", "1", "--out", str(run), *sets)
    assert code == 0, err
    assert "nothing was written" in out and "for this dry run only" in err
    code, out, err = run_main(capsys, "train", "--dry-run", "--nproc", "1", "--out", str(run), "--resume", *sets)
    assert code == 2 and "no checkpoint to resume" in err and "Traceback" not in err
    code, out, err = run_main(capsys, "verify", "--dry-run", "--strategy", "ddp", "--nproc", "1", "--out", str(run),
                              *sets)
    assert code == 0, err
    assert _tree(tmp_path) == before  # no cache folder, no .lock file, no run folder

    # A cache entry that exists is read as it is (no rebuild, no new file, not even a lock file).
    cfg = load_config(None, [*text_overrides(data, tok, cache)])
    load_text(cfg.data, 32)
    capsys.readouterr()
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file\n")
    before = _tree(tmp_path)
    for extra in ([], ["--resume"]):
        code, out, err = run_main(capsys, "train", "--dry-run", "--nproc", "1", "--out", str(run), *extra, *sets)
        assert code == (2 if extra else 0), err
        assert "tokenising" not in err
    assert _tree(tmp_path) == before
