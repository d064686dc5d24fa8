"""Every bad number, string and flag is one paragraph and exit 2, before anything starts.

The issue's list (tracebacks, hangs, exit 0 on nonsense), case by case, through the command line
in-process. The schema-driven fuzzer (test_fuzz_config.py) covers the same ground at random.
"""

from __future__ import annotations

import os

import pytest

from shardwise.cli import main
from shardwise.core.config import load_config, to_toml
from tests.helpers.ckpt import cli_args, fast_overrides, small_text


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "binary.toml").write_bytes(bytes(range(256)))
    (d / "latin1.toml").write_bytes("name = 'caf\xe9'\n".encode("latin-1"))
    (d / "a-file").write_text("not a directory")
    (d / "binary.dat").write_bytes(bytes(range(256)) * 40)
    return d, small_text(d)


def _run(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


# (name, extra argv, expected fragment of the message). {d} is the inputs folder.
CASES = [
    # --- tracebacks before
    ("lr nan", ["--set", "train.lr=nan"], "train.lr must be a finite number"),
    ("betas out of range", ["--set", "train.betas=[1.5,0.9]"], "train.betas[0] must be >= 0 and < 1"),
    ("negative workers", ["--set", "data.num_workers=-1"], "data.num_workers must be between 0 and 256"),
    ("binary TOML", ["{d}/binary.toml"], "is not UTF-8 text"),
    ("non-UTF-8 TOML", ["{d}/latin1.toml"], "is not UTF-8 text"),
    ("--out is a file", ["--out", "{d}/a-file"], "is a regular file, not a directory"),
    ("--out under /proc", ["--out", "/proc/self/no/such/run"], "cannot create the run directory"),
    ("--out not encodable", ["--out", "{d}/run-\udcff"], "--out is not valid UTF-8 text"),
    ("GPT override unknown key", ["--set", "model.overrides={n_hed=3}"], "unknown model.overrides key 'n_hed'"),
    ("custom override unknown key", ["--set", "model.kind=custom", "--set",
                                     'model.factory="tests.helpers.models:build_mlp"', "--set",
                                     "model.overrides={widht=8}"], "unexpected keyword argument 'widht'"),
    ("factory signature", ["--set", "model.kind=custom", "--set", 'model.factory="tests.helpers.models:ResidualMLP"',
                           "--set", "model.overrides={widht=8}"], "do not fit tests.helpers.models:ResidualMLP"),
    ("n_head=3", ["--set", "model.overrides={n_head=3}"], "n_embd=32 must be divisible by n_head=3"),
    ("dropout=2", ["--set", "model.overrides={dropout=2.0}"], "model.overrides.dropout must be >= 0 and < 1"),
    ("n_embd=-32", ["--set", "model.overrides={n_embd=-32}"], "model.overrides.n_embd must be > 0"),
    ("n_layer a string", ["--set", 'model.overrides={n_layer="two"}'], "model.overrides.n_layer must be int"),
    ("data.path binary", ["--set", 'data.path="{d}/binary.dat"'], "is not UTF-8 text"),
    ("factory os:getcwd", ["--set", "model.kind=custom", "--set", "model.factory=os:getcwd"],
     "returned a str, not a torch.nn.Module"),
    ("watchdog timeout nan", ["--set", "watchdog.timeout_s=nan"], "watchdog.timeout_s must be a finite number"),
    ("watchdog timeout inf", ["--set", "watchdog.timeout_s=inf"], "watchdog.timeout_s must be a finite number"),
    ("collective timeout inf", ["--set", "watchdog.collective_timeout_s=inf"],
     "watchdog.collective_timeout_s must be a finite number"),
    # --- hangs before
    ("steps 1e20", ["--set", "train.steps=99999999999999999999"], "train.steps must be > 0 and <= 1000000000"),
    ("--nnodes without endpoint", ["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    # --- exit 0 on nonsense before
    ("lr inf", ["--set", "train.lr=inf"], "train.lr must be a finite number"),
    ("grad_clip nan", ["--set", "train.grad_clip=nan"], "train.grad_clip must be a finite number"),
    ("weight decay -1", ["--set", "train.weight_decay=-1"], "train.weight_decay must be between 0 and 100"),
    ("node rank 5 of 1", ["--node-rank", "5", "--nnodes", "1"], "--node-rank must be between 0 and --nnodes - 1"),
    ("sample tokens -5", ["--set", "train.sample_tokens=-5"], "train.sample_tokens must be between 0 and 100000"),
    # --- a newline in the run name (config.toml could not be read back)
    ("name with newline", ["--set", 'name="a\\nb"'], "name contains the control character '\\n'"),
    # --- more of the same kind
    ("min_lr above lr", ["--set", "train.lr=1e-3", "--set", "train.min_lr=1e-2"], "must not exceed train.lr"),
    ("lr too large to be a float", ["--set", "train.lr=1" + "0" * 400], "too large a number"),
    ("bad endpoint", ["--nnodes", "2", "--rdzv-endpoint", "node0:http"], "--rdzv-endpoint must be HOST:PORT"),
    ("negative restarts", ["--max-restarts", "-1"], "--max-restarts must be between 0 and 1000"),
    ("nproc 0", ["--nproc", "0"], "--nproc must be at least 1"),
    ("name with a slash", ["--set", 'name="../elsewhere"'], "cannot name a run directory"),
    ("--set two values", ["--set", "train.steps=5\n[train]\nlr=1"], "train.steps must be int"),
    ("unknown nonfinite mode", ["--set", "train.nonfinite=ignore"], "unknown train.nonfinite mode 'ignore'"),
    ("--overwrite with --resume", ["--overwrite", "--resume"], "--overwrite starts a fresh run"),
]


@pytest.mark.parametrize("name, extra, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_paragraph_and_exit_2(capsys, files, tmp_path, name, extra, message):
    d, data = files
    out = tmp_path / "run"
    extra = [a.replace("{d}", str(d)) for a in extra]
    recipe = [extra.pop(0)] if extra and extra[0].endswith(".toml") else []
    argv = ["train", *recipe, "--nproc", "1", *cli_args(fast_overrides(data, steps=2, micro_batch=16)),
            "--out", str(out), *extra]
    code, err = _run(capsys, argv)
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not out.exists() or not any(out.iterdir())  # nothing started, nothing written


def test_launch_checks_the_same_multi_node_flags(capsys, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    code, err = _run(capsys, ["launch", "--nnodes", "2", str(script)])
    assert code == 2 and "--nnodes 2 needs --rdzv-endpoint" in err
    code, err = _run(capsys, ["launch", "--node-rank", "1", str(script)])
    assert code == 2 and "--node-rank must be between 0" in err


def test_control_characters_in_values_are_escaped_and_read_back(tmp_path):
    # Values handed to a model builder may hold any text; config.toml escapes it and reads back equal.
    cfg = load_config(None, ['model.overrides={note = "tab\\there\\nnew line \\u0001 \\"quoted\\" back\\\\slash"}'])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    again = load_config(str(path))
    assert again == cfg and again.model.overrides["note"].startswith("tab\there\nnew line \x01")


def test_a_resumed_run_reads_back_its_own_config_toml(tmp_path, capsys):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    args = cli_args([*fast_overrides(data, steps=2, every=1, micro_batch=16), 'name="Schöne Grüße, 東京 run"'])
    assert main(["train", "--nproc", "1", "--out", str(out), *args]) == 0
    assert main(["train", "--nproc", "1", "--out", str(out), "--resume", "--set", "train.steps=3"]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert load_config(str(out / "config.toml")).name == "Schöne Grüße, 東京 run"


def test_dry_run_checks_everything_and_writes_nothing(tmp_path, capsys):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    code = main(["train", "--nproc", "1", "--out", str(out), "--dry-run",
                 *cli_args(fast_overrides(data, steps=2, micro_batch=16))])
    captured = capsys.readouterr()
    assert code == 0 and "every check passed" in captured.out
    assert f"run directory: {out} (a new run directory)" in captured.out
    assert not out.exists()
    assert os.listdir(tmp_path) == ["small.txt"]
