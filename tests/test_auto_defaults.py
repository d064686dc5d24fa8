"""``parallel.precision = "auto"`` and ``train.compile = "auto"``: resolved in one place (runtime.auto)
for the device, explicit values win, and a run's config.toml records what was chosen."""

import pytest
import torch

from shardwise.core.config import from_dict, load_config, to_toml
from shardwise.core.layout import resolve_layout
from shardwise.parallel.implementations import get_strategy
from shardwise.runtime import auto
from shardwise.runtime.auto import CompileRecord, resolve_compile, resolve_precision


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine whose torch says it has a CUDA GPU; ``bf16`` sets whether it supports bfloat16."""
    state = {"bf16": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: state["bf16"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    return state


def test_defaults_are_auto():
    cfg = load_config(None)
    assert cfg.parallel.precision == "auto" and cfg.train.compile == "auto"


def test_precision_auto_is_fp32_on_the_cpu_and_bf16_mixed_on_a_bf16_gpu(fake_cuda):
    assert resolve_precision("auto", "cpu").value == "fp32"
    choice = resolve_precision("auto", "cuda")
    assert (choice.value, choice.auto) == ("bf16-mixed", True)
    assert resolve_precision("auto").value == "bf16-mixed"  # the device this process would pick
    fake_cuda["bf16"] = False  # e.g. a V100: fp16 needs loss scaling, so it is never chosen silently
    assert resolve_precision("auto", "cuda").value == "fp32"


def test_explicit_values_win(fake_cuda):
    for value in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true"):
        assert resolve_precision(value, "cuda").value == value
        assert resolve_precision(value, "cpu").value == value
    for value, want in ((True, True), (False, False), ("true", True), ("false", False)):
        for dev in ("cpu", "cuda"):
            choice = resolve_compile(value, dev, steps=1, unsupported="whatever")
            assert (choice.value, choice.auto) == (want, False)


def test_compile_auto_pays_back_its_compile_time():
    # With the priors (module docstring): on when steps x gain > compile time, off below it.
    for dev in ("cpu", "cuda"):
        gain = auto.PRIOR_GAIN_FRACTION[dev] * auto.PRIOR_EAGER_STEP_S[dev]
        break_even = auto.PRIOR_COMPILE_S[dev] / gain
        short = resolve_compile("auto", dev, steps=int(break_even * 0.9))
        long = resolve_compile("auto", dev, steps=int(break_even * 1.1) + 1)
        assert not short.value and short.reason.startswith("off: ") and "too short" in short.reason
        assert long.value and long.reason.startswith("on: ") and "pays back after" in long.reason
    # Unknown length: a GPU job is taken as long, a CPU one is not compiled.
    assert resolve_compile("auto", "cuda", steps=None).value
    assert not resolve_compile("auto", "cpu", steps=None).value
    # Where it cannot run or is not known to help, off with the reason.
    refused = resolve_compile("auto", "cuda", steps=10**6, unsupported="no compiler")
    assert not refused.value and "no compiler" in refused.reason
    assert not resolve_compile("auto", "mps", steps=10**6).value


def test_compile_auto_uses_this_machines_measurements(tmp_path):
    # 10 s to compile and 50 ms saved per step: pays back after 200 steps.
    rec = CompileRecord(compile_s=10.0, compiled_step_s=0.15, eager_step_s=0.2)
    assert resolve_compile("auto", "cpu", steps=250, record=rec).value
    assert not resolve_compile("auto", "cpu", steps=150, record=rec).value
    slower = CompileRecord(compile_s=10.0, compiled_step_s=0.25, eager_step_s=0.2)
    off = resolve_compile("auto", "cuda", steps=10**9, record=slower)
    assert not off.value and "not faster" in off.reason
    # Measured runs land in the cache: the compile time is the first steps' excess over the steady step.
    assert auto.record_run("job", False, [0.2] * 10, cache_dir=tmp_path).eager_step_s == pytest.approx(0.2)
    got = auto.record_run("job", True, [4.0, 3.0, 3.1] + [0.1] * 10, cache_dir=tmp_path)
    assert got.compile_s == pytest.approx(10.1 - 0.3) and got.compiled_step_s == pytest.approx(0.1)
    assert auto.load_record("job", cache_dir=tmp_path) == got
    assert auto.load_record("other", cache_dir=tmp_path) is None


def test_a_resolved_config_records_the_choice_and_reads_back(fake_cuda):
    cfg = load_config(None, ["train.steps=100000"])
    strategy = get_strategy(resolve_layout(cfg.parallel, 1))
    resolved, notes = auto.resolve_precision_in(cfg, "cuda")
    resolved, more = auto.resolve_compile_in(resolved, strategy, "cuda", world_size=1)
    assert resolved.parallel.precision == "bf16-mixed" and resolved.train.compile == "true"
    assert len(notes + more) == 2 and all("'auto' ->" in n for n in notes + more)
    again = load_config(_write(to_toml(resolved)))
    assert again == resolved  # a resumed run keeps what it started with
    assert auto.resolve_precision_in(again, "cpu") == (again, [])  # nothing left to decide
    # A config.toml written before "auto" existed (train.compile as a TOML boolean) still loads.
    old = from_dict({"train": {"compile": False}, "parallel": {"precision": "fp32"}})
    assert old.train.compile == "false" and old.parallel.precision == "fp32"


def test_peers_run_auto_settings_at_their_own_defaults():
    cfg = auto.peer_defaults(load_config(None))
    assert cfg.parallel.precision == "fp32" and cfg.train.compile == "false"
    explicit = load_config(None, ["parallel.precision=bf16-mixed", "train.compile=true"])
    assert auto.peer_defaults(explicit) == explicit


def test_session_resolves_auto_on_the_cpu():
    from shardwise.runtime.session import Session

    with Session() as s:
        assert s.options.precision == "fp32" and s.compile is False and s.compile_choice.auto
    with Session(compile=True, precision="bf16") as s:
        assert s.options.precision == "bf16-mixed" and s.compile is True


def _write(text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    return f.name


def test_the_nodes_of_a_job_decide_from_the_priors(tmp_path, monkeypatch):
    # Each node has its own cache; their resolved configs name their rendezvous, so must agree.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = load_config(None, ["train.steps=300", "parallel.precision=fp32"])
    strategy = get_strategy(resolve_layout(cfg.parallel, 1))
    key = auto.job_key(cfg, "cpu", 1)
    auto.record_run(key, False, [2.0] * 10)  # a slow eager step measured here: compile pays back after 105 steps
    measured, _ = auto.resolve_compile_in(cfg, strategy, "cpu", world_size=1)
    priors, notes = auto.resolve_compile_in(cfg, strategy, "cpu", world_size=1, measured=False)
    assert measured.train.compile == "true" and priors.train.compile == "false"
    assert "prior" in notes[0]


def test_train_dry_run_prints_what_auto_decided(capsys):
    from shardwise.cli import main

    assert main(["train", "--dry-run", "--nproc", "1", "--set", "model.preset=nano"]) == 0
    out = capsys.readouterr().out
    assert "parallel.precision = 'auto' -> 'fp32'" in out and "train.compile = 'auto' -> false" in out
