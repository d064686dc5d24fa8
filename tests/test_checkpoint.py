"""Sharded checkpoints: atomic publish, rotation, manifest checks, bad input, safety, export/inspect."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardwise.cli import main
from shardwise.core.config import ParallelConfig
from shardwise.errors import CheckpointError
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.checkpoint.export import export_weights, inspect_checkpoint
from shardwise.runtime.checkpoint.load import load_checkpoint
from shardwise.runtime.checkpoint.locate import latest_checkpoint, resolve_checkpoint
from shardwise.runtime.checkpoint.manifest import MANIFEST, PARTIAL_OWNER, body_checksum, read_manifest, sha256_file
from shardwise.runtime.checkpoint.preflight import preflight
from shardwise.runtime.checkpoint.safe_read import SafeFileSystemReader, SafeLoadPlanner
from shardwise.runtime.checkpoint.save import save_checkpoint
from shardwise.runtime.session import Session
from shardwise.testing import DistributedTestError, run_distributed
from tests.helpers.ckpt import fast_overrides, small_text


def _trained(steps: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPT_PRESETS["nano"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (4, 16))
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(root, step: int, model=None, opt=None, keep_last: int = 0, **kw):
    if model is None:
        model, opt = _trained()
    return save_checkpoint(root, model, opt, step=step, strategy="single", world_size=1,
                                keep_last=keep_last, **kw)


def _rewrite_manifest(path, **changes) -> None:
    """Tamper with a manifest the way an attacker would: change it and fix its self-checksum."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(changes)
    manifest["checksum"] = body_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


# ------------------------------------------------------------------------- save / load / publish
def test_roundtrip_restores_model_optimizer_data_and_rng(tmp_path):
    model, opt = _trained()
    session = Session(seed=0)
    loader = session.dataloader(list(range(64)), batch_size=4)
    it = iter(loader)
    for _ in range(3):
        next(it)
    torch.manual_seed(123)
    path = session.save(tmp_path, model, opt, step=7, state={"note": "x"}, loader=loader)
    expected_draw = torch.rand(3)

    assert path.name == "step-00000007" and (tmp_path / "latest").read_text().strip() == path.name
    manifest = read_manifest(path)
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["strategy"] == "single"
    assert manifest["data"]["batch_in_epoch"] == 3 and manifest["state"] == {"note": "x"}
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "rng-rank0.json"}

    model2, opt2 = _trained(steps=0, seed=1)
    loader2 = session.dataloader(list(range(64)), batch_size=4)
    loaded = session.load(tmp_path, model2, opt2, loader=loader2)  # root: follows 'latest'
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG stream continues where it was saved
    assert loaded.step == 7 and loaded.path == path
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name])
    assert loader2.state_dict()["batch_in_epoch"] == 3
    assert torch.equal(next(iter(loader2)), next(it))  # continues with the next unseen batch
    session.close()


def test_rotation_keeps_last_and_latest_is_written_last(tmp_path):
    model, opt = _trained()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, opt, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path).name == "step-00000004"


def test_partial_checkpoint_is_never_used_and_cleaned_up(tmp_path):
    model, opt = _trained()
    good = _save(tmp_path, 2, model, opt)
    # A save killed half-way leaves a .partial- directory with shards but no manifest (and its
    # owner record: here a writer that is gone).
    partial = tmp_path / ".partial-step-00000004.0123456789ab"
    shutil.copytree(good, partial)
    (partial / MANIFEST).unlink()
    (partial / PARTIAL_OWNER).write_text(json.dumps({"job": "killed-job", "host": socket.gethostname(),
                                                          "pid": os.getpid(), "start_time": -1}))
    assert resolve_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        resolve_checkpoint(partial)
    _save(tmp_path, 3, model, opt, keep_last=5)  # the next save removes stale partial directories
    assert not partial.exists()


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    overrides = [*fast_overrides(data, steps=8, every=3), "debug.kill_rank=1", "debug.kill_at_step=6",
                 "debug.kill_in_checkpoint=true"]
    from tests.helpers.ckpt import train_rank

    with pytest.raises(DistributedTestError):  # rank 1 is killed mid-save; rank 0 then fails
        run_distributed(train_rank, 2, timeout_s=120, overrides=overrides, out=str(out))
    root = out / "checkpoints"
    assert len(list(root.glob(".partial-step-00000006.*"))) == 1  # shards of step 6 were being written
    assert latest_checkpoint(root).name == "step-00000003"
    assert inspect_checkpoint(root)["step"] == 3  # the previous checkpoint loads and verifies


# ------------------------------------------------------------------------- damaged / wrong input
@pytest.fixture
def saved(tmp_path):
    return _save(tmp_path / "ckpts", 5)


def _load(path):
    model, opt = _trained(steps=0)
    return load_checkpoint(path, model, opt, world_size=1)


def test_no_checkpoint_to_resume(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        _load(tmp_path / "empty")


def test_truncated_shard(saved):
    shard = saved / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has 1000 bytes.*truncated"):
        _load(saved)
    with pytest.raises(CheckpointError, match="truncated"):
        preflight(saved)


def test_corrupted_shard_same_size(saved):
    shard = saved / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its SHA-256 checksum"):
        _load(saved)


def test_tampered_manifest(saved):
    text = (saved / MANIFEST).read_text().replace('"step": 5', '"step": 50')
    (saved / MANIFEST).write_text(text)
    with pytest.raises(CheckpointError, match="modified after it was written"):
        _load(saved)
    (saved / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        _load(saved)


def test_incompatible_model_shape(saved):
    import dataclasses

    wider = GPT(dataclasses.replace(GPT_PRESETS["nano"], n_embd=64))
    opt = torch.optim.AdamW(wider.parameters(), lr=1e-3)
    expected = r"different shape: .*is \[32, 32\] float32 in the checkpoint and \[64, 64\]"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(saved, wider, opt, world_size=1)


# ------------------------------------------------------------------------- security
class _Evil:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_metadata_pickle_cannot_run_code(saved, tmp_path):
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    meta = saved / ".metadata"
    meta.write_bytes(pickle.dumps(_Evil()))
    # An attacker who also rewrites the manifest's checksums still cannot get code run.
    files = json.loads((saved / MANIFEST).read_text())["files"]
    files[".metadata"] = {"bytes": meta.stat().st_size, "sha256": sha256_file(meta)}
    _rewrite_manifest(saved, files=files)
    with pytest.raises(CheckpointError, match="refusing to load DCP metadata"):
        _load(saved)
    assert not marker.exists()


def test_metadata_checked_against_manifest_before_unpickling(saved):
    meta = saved / ".metadata"
    meta.write_bytes(meta.read_bytes() + b"\x00")
    files = json.loads((saved / MANIFEST).read_text())["files"]
    files[".metadata"]["bytes"] += 1  # size fixed up, checksum not
    _rewrite_manifest(saved, files=files)
    with pytest.raises(CheckpointError, match="SHA-256"):
        inspect_checkpoint(saved)


def test_non_tensor_entries_are_loaded_weights_only(tmp_path):
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    dcp.save({"x": torch.ones(2), "evil": _Evil()}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    marker.unlink(missing_ok=True)
    target = {"x": torch.zeros(2), "evil": None}
    reader = SafeFileSystemReader(tmp_path / "c", expected_sha256=None)
    with pytest.raises(dcp.api.CheckpointException, match="refusing to load the entry 'evil'"):
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()


# ------------------------------------------------------------------------- inspect / export CLI
def test_inspect_and_export_cli(saved, tmp_path, capsys):
    assert main(["ckpt", "inspect", str(saved.parent)]) == 0
    out = capsys.readouterr().out
    assert "step         5" in out and "strategy single on 1 rank" in out
    assert "tok_emb.weight" in out and "all checksums verified" in out
    assert main(["ckpt", "inspect", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"]["model"]["tensors"] == 37

    target = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(saved), "--out", str(target)]) == 0
    plain = GPT(GPT_PRESETS["nano"])
    plain.load_state_dict(load_file(target))  # strict: every weight present, nothing extra
    model, _ = _trained()
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_ckpt_cli_bad_input(tmp_path, capsys):
    assert main(["ckpt", "inspect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    assert main(["ckpt", "export", str(path), "--out", str(tmp_path / "w.bin")]) == 2
    assert "must end in .safetensors" in capsys.readouterr().err


# ------------------------------------------------------------------------- two ranks
def _save_two_ranks(rank: int, world_size: int, root: str, strategy: str) -> list[str]:
    session = Session(parallel=ParallelConfig(strategy=strategy), seed=0)
    model = GPT(GPT_PRESETS["nano"])
    model, opt = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(rank))
    session.forward_backward(model, x, x, lambda o, t: torch.nn.functional.cross_entropy(
        o.flatten(0, 1), t.flatten()))
    session.step(opt)
    path = session.save(root, model, opt, step=1)
    session.close()
    return sorted(os.listdir(path))


@pytest.mark.parametrize("strategy", ["fsdp"])
def test_every_rank_writes_its_shard_and_export_consolidates(tmp_path, strategy):
    files = run_distributed(_save_two_ranks, 2, timeout_s=120, root=str(tmp_path), strategy=strategy)[0]
    assert {"__0_0.distcp", "__1_0.distcp", "rng-rank0.json", "rng-rank1.json", "manifest.json"} <= set(files)
    info = inspect_checkpoint(tmp_path)
    assert info["strategy"] == strategy and info["world_size"] == 2
    result = export_weights(tmp_path, tmp_path / "w.safetensors")
    plain = GPT(GPT_PRESETS["nano"])
    plain.load_state_dict(load_file(result["out"]))
    assert result["tensors"] == len(plain.state_dict())


def test_every_strategy_names_a_checkpoint_engine_the_checkpoints_know():
    """A strategy names its engine by string (parallel/ cannot import runtime/): each must be one the
    checkpoint engines list, DCP or a registered one, so a save never meets an unknown name."""
    from shardwise.parallel.implementations import IMPLEMENTATIONS
    from shardwise.runtime.checkpoint.engines import ENGINES, engine_for
    from shardwise.runtime.checkpoint.manifest import DCP

    named = {cls.checkpoint_engine for cls in IMPLEMENTATIONS.values()}
    assert named == {DCP, *ENGINES}, named
    for name in named:
        engine_for(name)  # raises CheckpointError for a name it does not know
    with pytest.raises(CheckpointError, match="not one this shardwise knows"):
        engine_for("megatron")


def _zero1_cases(rank: int, world_size: int, ckpt: str) -> list[dict]:
    from tests.helpers.zero1_small import zero1_small

    return [zero1_small(rank, world_size, "zero1", range(4)),
            zero1_small(rank, world_size, "zero1", range(2), save=ckpt),
            zero1_small(rank, world_size, "zero1", range(2, 4), load=ckpt),
            zero1_small(rank, world_size, "ddp", range(2, 4), load=ckpt)]


def test_zero1_ranks_that_own_no_parameter_save_and_resume(tmp_path):
    """ZeRO-1 hands out whole tensors: with more ranks than parameters some ranks own none. Their
    save failed inside torch ("optim state_dict is empty"), so no checkpoint of such a run was ever
    written (found rehearsing hf-llama-tiny zero1 at 64 ranks, rank 63). 4 ranks, 2 tensors: saved
    after step 2 and resumed under zero1 and under ddp, steps 3-4 equal the uninterrupted run."""
    ranks = run_distributed(_zero1_cases, 4, timeout_s=180, ckpt=str(tmp_path / "ckpt"))
    whole, first, resumed, as_ddp = ranks[0]
    assert first["losses"] == whole["losses"][:2]
    for other in (resumed, as_ddp):
        assert other["losses"] == pytest.approx(whole["losses"][2:], abs=1e-12)
        for name, value in whole["params"].items():
            torch.testing.assert_close(other["params"][name], value, atol=1e-12, rtol=0)
