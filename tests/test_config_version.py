"""config_version: a saved run's config.toml written when parallel.dp_shard still counted the cp ranks
is read in today's meaning (dp_shard excludes cp) with a note, or refused with what changed -- never
silently reinterpreted; a run directory from before resumes."""

from __future__ import annotations

import json
import re

import pytest

from shardwise.core.config import load_config, to_toml
from shardwise.core.config_version import CONFIG_VERSION, upgrade
from shardwise.errors import ConfigError
from tests.helpers.ckpt import cli_args, fast_overrides, run_cli, small_text

OLD_RUN = {"name": "x", "out_dir": "runs/x", "parallel": {"nproc": 4, "dp_shard": 4, "cp": 2}}


def test_written_configs_carry_the_version_and_read_back_equal(tmp_path) -> None:
    cfg = load_config(None, ["parallel.dp_shard=2", "parallel.cp=2"])
    text = to_toml(cfg)
    assert f"config_version = {CONFIG_VERSION}" in text
    path = tmp_path / "config.toml"
    path.write_text(text)
    assert load_config(str(path)) == cfg  # versioned: read as written, dp_shard=2 stays 2


def test_old_run_config_is_converted_with_a_note(capsys) -> None:
    new = upgrade(OLD_RUN, "'runs/x/config.toml'")
    assert new["parallel"]["dp_shard"] == 2 and new["config_version"] == CONFIG_VERSION
    assert OLD_RUN["parallel"]["dp_shard"] == 4  # the caller's dict is left as it was
    assert "read as dp_shard = 2 x cp = 2" in capsys.readouterr().err


@pytest.mark.parametrize("raw, message", [
    # A hand-written file without a version: which meaning it has is the author's to say.
    ({"parallel": {"dp_shard": 4, "cp": 2}}, "has no config_version. dp_shard excludes cp since config_version 2"),
    ({**OLD_RUN, "parallel": {"nproc": 4, "dp_shard": 3, "cp": 2}}, "must then be a multiple of"),
    ({"config_version": CONFIG_VERSION + 1}, "A newer shardwise wrote it"),
])
def test_ambiguous_or_newer_configs_are_refused(raw, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        upgrade(raw, "'f.toml'")


def test_configs_both_versions_read_alike_pass_unchanged() -> None:
    for raw in ({"parallel": {"dp_shard": 4}}, {"parallel": {"cp": 2}}, {**OLD_RUN, "config_version": 1,
                                                                         "parallel": {"cp": 1, "dp_shard": 2}}):
        assert upgrade(raw, "'f.toml'") is raw


@pytest.mark.slow
def test_run_directory_from_before_resumes(tmp_path, cli_env) -> None:
    """A 2-rank fsdp x cp=2 run whose config.toml is rewritten as the previous version wrote it
    (no config_version, dp_shard = 2 counting the cp ranks) resumes from its checkpoint."""
    data = small_text(tmp_path)
    out = tmp_path / "run"
    first = run_cli(["train", "--nproc", "2", "--out", str(out), "--set", "parallel.dp_shard=1",
                     "--set", "parallel.cp=2", *cli_args(fast_overrides(data, steps=2, every=2))], cli_env)
    assert first.returncode == 0, first.stdout + first.stderr
    saved = out / "config.toml"
    text = saved.read_text()
    assert "config_version = 2" in text and "dp_shard = 1" in text
    saved.write_text(text.replace("config_version = 2\n", "").replace("dp_shard = 1\n", "dp_shard = 2\n"))

    resumed = run_cli(["train", "--out", str(out), "--resume", "--set", "train.steps=4"], cli_env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "read as dp_shard = 1 x cp = 2" in resumed.stderr and "resumed from" in resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["layout"]["dp_shard"] == 1 and summary["layout"]["cp"] == 2
    assert "config_version = 2" in saved.read_text()  # written again in today's meaning
