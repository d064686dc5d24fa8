"""A pretrained folder cannot read outside itself, and every safetensors header is checked whole.

Index entries with ``..``, absolute paths, ``/etc/passwd``, symbolic links out of the folder,
non-string entries and malformed headers (string offsets or shapes, negative or overlapping
offsets, deep nesting, an absurd header length) are refused before any rank starts, with a
message naming the entry and the folder and never quoting bytes of a refused file. A
``checkpoints/latest`` that is a link is never followed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

pytest.importorskip("transformers")

from shardwise.errors import CheckpointError, ConfigError  # noqa: E402
from shardwise.models.pretrained import INDEX_FILE, inspect_pretrained  # noqa: E402
from shardwise.models.safetensors_header import read_safetensors_header  # noqa: E402
from tests.helpers.hf import save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("confine") / "llama-sharded", "llama", shard_kb=40, seed=2)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _set_index(folder, first_file_to):
    index = json.loads((folder / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"] = {k: (first_file_to if v == files[0] else v) for k, v in index["weight_map"].items()}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return files[0]


def test_index_entries_outside_the_folder_are_refused_before_opening(sharded, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    first = sorted(set(json.loads((sharded / INDEX_FILE).read_text())["weight_map"].values()))[0]
    shutil.copy(sharded / first, outside / "model.safetensors")  # a valid file: it would load
    cases = {
        "../outside/model.safetensors": "not a plain file name inside the folder",
        str(outside / "model.safetensors"): "not a plain file name inside the folder",
        "/etc/passwd": "not a plain file name inside the folder",
        "/proc/self/mem": "not a plain file name inside the folder",
        "sub/dir.safetensors": "not a plain file name inside the folder",
        "..": "not a plain file name inside the folder",
    }
    for n, (entry, message) in enumerate(cases.items()):
        folder = _copy(sharded, tmp_path / f"case{n}")
        _set_index(folder, entry)
        with pytest.raises(ConfigError, match=message) as e:
            inspect_pretrained(folder)
        text = str(e.value)
        assert repr(entry) in text and str(folder) in text, text
        assert "root:" not in text and "claims" not in text
    # Not a string at all: a clear refusal, not a TypeError.
    folder = _copy(sharded, tmp_path / "int-entry")
    _set_index(folder, 7)
    with pytest.raises(ConfigError, match="names a weight file as int 7"):
        inspect_pretrained(folder)


def test_symbolic_links_out_of_the_folder_are_refused(sharded, tmp_path):
    outside = tmp_path / "outside.safetensors"
    folder = _copy(sharded, tmp_path / "linked")
    first = _set_index(folder, "link.safetensors")
    shutil.move(folder / first, outside)
    os.symlink(outside, folder / "link.safetensors")
    with pytest.raises(ConfigError, match="is a symbolic link to .*outside the folder") as e:
        inspect_pretrained(folder)
    assert "'link.safetensors'" in str(e.value)
    # A link to /etc/passwd as the single weight file: refused without reading it.
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(sharded / "config.json", single / "config.json")
    os.symlink("/etc/passwd", single / "model.safetensors")
    with pytest.raises(ConfigError, match="outside the folder") as e:
        inspect_pretrained(single)
    assert "root" not in str(e.value).replace(str(single), "")
    # Links inside the folder, and a Hugging Face cache snapshot linking into its repo's blobs/, load.
    inner = _copy(sharded, tmp_path / "inner")
    name = _set_index(inner, "alias.safetensors")
    os.symlink(name, inner / "alias.safetensors")
    assert inspect_pretrained(inner).files
    repo = tmp_path / "models--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sharded.iterdir():
        shutil.copy(f, repo / "blobs" / f.name)
        os.symlink(os.path.relpath(repo / "blobs" / f.name, snap), snap / f.name)
    assert inspect_pretrained(snap).files


def _safetensors(path, header, data_bytes=64):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


def test_malformed_headers_are_refused_not_crashed(tmp_path):
    good = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    cases = {
        "string offsets": ({"a": {**good, "data_offsets": ["0", "16"]}}, "not two integers"),
        "string in shape": ({"a": {**good, "shape": [2, "2"]}}, "not a list of non-negative integers"),
        "negative offsets": ({"a": {**good, "data_offsets": [-16, 0], "shape": [4]}}, "negative or reversed"),
        "reversed offsets": ({"a": {**good, "data_offsets": [16, 0]}}, "negative or reversed"),
        "overlap": ({"a": good, "b": {**good, "data_offsets": [8, 24]}}, "overlap"),
        "not an object": ({"a": [1, 2]}, "is not an object"),
        "bool shape": ({"a": {**good, "shape": [True, 2]}}, "not a list of non-negative integers"),
        "past the end": ({"a": {**good, "shape": [40], "data_offsets": [0, 160]}}, "truncated"),
    }
    for n, (header, message) in enumerate(cases.values()):
        with pytest.raises(ConfigError, match=message):
            read_safetensors_header(_safetensors(tmp_path / f"h{n}.safetensors", header))
    deep = tmp_path / "deep.safetensors"
    raw = b"[" * 100000 + b"]" * 100000
    deep.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ConfigError, match="nested too deeply"):
        read_safetensors_header(deep)
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n" * 4)
    with pytest.raises(ConfigError, match="header length is out of range") as e:
        read_safetensors_header(text)
    assert str(int.from_bytes(b"root:x:0", "little")) not in str(e.value)


def test_latest_linked_outside_the_run_is_never_followed(tmp_path):
    from shardwise.runtime.checkpoint.locate import latest_checkpoint

    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("step-00000001 and more secrets")
    os.symlink(secret, root / "latest")
    with pytest.raises(CheckpointError, match="not a regular file") as e:
        latest_checkpoint(root)
    assert "secrets" not in str(e.value)
