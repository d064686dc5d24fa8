"""A checkpoint from someone else: everything it names must stay inside it, and bad files are clear errors.

The security cases. The attacker may rewrite any file *and* the manifest (its checksums
and self-checksum are not a signature), so every test here forges a consistent manifest: what
stops the attack is confinement and validation, not the checksum.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys

import pytest
import torch

from shardwise.cli import main
from shardwise.errors import CheckpointError
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.checkpoint.export import read_full_model_state
from shardwise.runtime.checkpoint.load import load_checkpoint
from shardwise.runtime.checkpoint.locate import complete_checkpoints
from shardwise.runtime.checkpoint.manifest import MANIFEST, body_checksum, read_manifest, sha256_file
from shardwise.runtime.checkpoint.save import save_checkpoint
from shardwise.testing import run_command


def _saved(root, step: int = 3):
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["nano"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return save_checkpoint(root, model, opt, step=step, strategy="single", world_size=1)


def _forge_manifest(path, **changes) -> None:
    """Rewrite the manifest as an attacker would: change it, then fix every checksum."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name in manifest["files"]:
        file = path / name
        if file.is_file() and not file.is_symlink():
            manifest["files"][name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
    manifest.update(changes)
    manifest["checksum"] = body_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def _edit_metadata(path, edit) -> None:
    """Unpickle .metadata (this test trusts its own file), let ``edit`` change it, write it back."""
    meta = pickle.loads((path / ".metadata").read_bytes())  # noqa: S301 - the test's own checkpoint
    edit(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    _forge_manifest(path)


def _point_storage_at(path, target: str) -> None:
    def edit(meta):
        for info in meta.storage_data.values():
            info.relative_path = target
    _edit_metadata(path, edit)


def _load(path):
    torch.manual_seed(1)
    model = GPT(GPT_PRESETS["nano"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return load_checkpoint(path, model, opt, world_size=1)


def _one_paragraph(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ DCP metadata storage entries
@pytest.mark.parametrize("where", ["outside", "absolute"])
def test_metadata_pointing_outside_the_checkpoint_is_refused_before_reading(tmp_path, where):
    path = _saved(tmp_path / "ckpts")
    outside = tmp_path / "planted.distcp"
    shutil.copy(path / "__0_0.distcp", outside)  # a well-formed shard, just not this checkpoint's
    _point_storage_at(path, "../../planted.distcp" if where == "outside" else str(outside))
    with pytest.raises(CheckpointError, match="not a data file listed in the manifest"):
        _load(path)
    with pytest.raises(CheckpointError, match="not a data file listed in the manifest"):
        read_full_model_state(path)


def test_metadata_pointing_at_a_fifo_fails_fast_instead_of_blocking(tmp_path, cli_env):
    path = _saved(tmp_path / "ckpts")
    os.mkfifo(path / "pipe.distcp")
    _point_storage_at(path, "pipe.distcp")
    # A real user command: before the fix, this read blocked forever on the FIFO.
    proc = run_command([sys.executable, "-m", "shardwise", "ckpt", "export", str(path), "--out",
                        str(tmp_path / "w.safetensors")], env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pipe.distcp" in proc.stderr and "Traceback" not in proc.stderr


def test_a_listed_file_that_is_a_fifo_or_symlink_is_not_read(tmp_path):
    path = _saved(tmp_path / "ckpts")
    manifest = json.loads((path / MANIFEST).read_text())
    os.unlink(path / "rng-rank0.json")
    os.mkfifo(path / "rng-rank0.json")
    with pytest.raises(CheckpointError, match="rng-rank0.json is not a regular file"):
        _load(path)
    os.unlink(path / "rng-rank0.json")
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    os.symlink(secret, path / "rng-rank0.json")
    manifest["files"]["rng-rank0.json"] = {"bytes": 2, "sha256": sha256_file(secret)}
    _forge_manifest(path, files=manifest["files"])
    with pytest.raises(CheckpointError, match="symbolic link"):
        _load(path)


# ------------------------------------------------------------------ manifest file names
@pytest.mark.parametrize("name", ["/etc/hostname", "../../outside.txt", "sub/dir.distcp", "a\x00b"])
def test_manifest_names_must_stay_inside_the_checkpoint(tmp_path, capsys, name):
    path = _saved(tmp_path / "ckpts")
    target = "/etc/hostname" if name == "/etc/hostname" else tmp_path / "outside.txt"
    if name != "/etc/hostname":
        (tmp_path / "outside.txt").write_text("not yours")
    files = json.loads((path / MANIFEST).read_text())["files"]
    files[name] = {"bytes": os.path.getsize(target), "sha256": sha256_file(target)}
    _forge_manifest(path, files=files)
    err = _one_paragraph(capsys, ["ckpt", "inspect", str(path)])
    assert "not a plain name inside the checkpoint directory" in err and "verified" not in err


def test_a_step_directory_that_is_a_symlink_is_not_followed(tmp_path, capsys):
    elsewhere = _saved(tmp_path / "elsewhere", step=9)
    root = tmp_path / "run" / "checkpoints"
    _saved(root, step=3)
    os.symlink(elsewhere, root / "step-00000009")
    (root / "latest").write_text("step-00000009\n")
    err = _one_paragraph(capsys, ["ckpt", "inspect", str(root)])
    assert "step-00000009" in err
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000003"]
    with pytest.raises(CheckpointError, match="symbolic link"):
        read_manifest(root / "step-00000009")
    with pytest.raises(CheckpointError, match="symbolic link"):
        _load(root / "step-00000009")


# ------------------------------------------------------------------ malformed files, clear errors
def test_garbage_metadata_with_a_matching_checksum_is_a_clear_error(tmp_path, capsys):
    path = _saved(tmp_path / "ckpts")
    for garbage in (b"\x80\x05garbage that is no pickle", os.urandom(512), pickle.dumps({"not": "metadata"})):
        (path / ".metadata").write_bytes(garbage)
        _forge_manifest(path)
        err = _one_paragraph(capsys, ["ckpt", "inspect", str(path)])
        assert ".metadata" in err
        with pytest.raises(CheckpointError, match=".metadata"):
            _load(path)


@pytest.mark.parametrize("field, value", [("model_tensors", None), ("files", None), ("step", "three"),
                                          ("data", {"epoch": 0}), ("world_size", 0),
                                          ("model_tensors", {"w": "oops"})])
def test_a_manifest_missing_or_mistyping_a_field_is_a_clear_error(tmp_path, capsys, field, value):
    path = _saved(tmp_path / "ckpts")
    manifest = json.loads((path / MANIFEST).read_text())
    if value is None:
        del manifest[field]
    else:
        manifest[field] = value
    manifest["checksum"] = body_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    err = _one_paragraph(capsys, ["ckpt", "inspect", str(path)])
    assert "not a valid shardwise manifest" in err and repr(field)[1:-1] in err
    with pytest.raises(CheckpointError, match="not a valid shardwise manifest"):
        _load(path)


def test_forged_rng_file_is_a_clear_error(tmp_path):
    path = _saved(tmp_path / "ckpts")
    (path / "rng-rank0.json").write_text(json.dumps({"rank": 0, "rng": {"python": [1, 2]}, "scaler": None}))
    _forge_manifest(path)
    with pytest.raises(CheckpointError, match="does not hold saved RNG streams"):
        _load(path)


def test_export_allocates_only_the_shapes_the_manifest_records(tmp_path, capsys):
    path = _saved(tmp_path / "ckpts")
    huge = torch.Size([2**40, 32])

    def grow(meta):
        meta.state_dict_metadata["model.tok_emb.weight"] = dataclasses.replace(
            meta.state_dict_metadata["model.tok_emb.weight"], size=huge)

    _edit_metadata(path, grow)
    err = _one_paragraph(capsys, ["ckpt", "export", str(path), "--out", str(tmp_path / "w.safetensors")])
    assert "tok_emb.weight" in err and "the manifest" in err
    # Forging the manifest's shapes as well does not help: no tensor may exceed the data on disk.
    tensors = json.loads((path / MANIFEST).read_text())["model_tensors"]
    tensors["tok_emb.weight"][0] = list(huge)
    _forge_manifest(path, model_tensors=tensors)
    err = _one_paragraph(capsys, ["ckpt", "export", str(path), "--out", str(tmp_path / "w.safetensors")])
    assert "tok_emb.weight" in err
    assert not (tmp_path / "w.safetensors").exists()


def test_a_shard_replaced_after_verification_is_not_loaded(tmp_path, monkeypatch):
    """Verified and read must be the same file: a swap in between (same size, other bytes) is refused."""
    import importlib

    load_module = importlib.import_module("shardwise.runtime.checkpoint.load")
    path = _saved(tmp_path / "ckpts")
    shard = path / "__0_0.distcp"
    real = load_module.read_dcp_metadata

    def swap_after_verification(*args, **kwargs):
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        tmp = path / "swap.tmp"
        tmp.write_bytes(bytes(data))
        os.replace(tmp, shard)
        return real(*args, **kwargs)

    monkeypatch.setattr(load_module, "read_dcp_metadata", swap_after_verification)
    with pytest.raises(CheckpointError, match="changed after it was verified"):
        _load(path)


def test_a_genuine_checkpoint_still_loads_and_exports(tmp_path, capsys):
    path = _saved(tmp_path / "ckpts")
    assert _load(path).step == 3
    assert main(["ckpt", "export", str(path), "--out", str(tmp_path / "w.safetensors")]) == 0
    assert "37 tensors" in capsys.readouterr().out
