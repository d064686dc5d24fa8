"""Hypothesis fuzzer for pretrained folders: safetensors headers and index files from anywhere.

Invariants: ``read_safetensors_header`` / ``inspect_pretrained`` either return a result whose
every tensor lies inside its file and whose every file is a plain name inside the folder, or raise
ConfigError with one paragraph that never quotes the 8-byte length field of a refused file; never
another exception (TypeError, RecursionError, OverflowError ...).

``SHARDWISE_FUZZ_EXAMPLES`` (default 300) sets the header cases (a third of it: index cases).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models.pretrained import INDEX_FILE, inspect_pretrained  # noqa: E402
from shardwise.models.safetensors_header import read_safetensors_header  # noqa: E402
from tests.helpers.hf import save_tiny  # noqa: E402

EXAMPLES = int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

ints = st.integers(-(2**70), 2**70) | st.integers(-3, 300)
junk = st.none() | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=6) | ints
entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "F64", "X9"]) | junk,
        "shape": st.lists(st.integers(-2, 9) | junk, max_size=4) | junk,
        "data_offsets": st.lists(ints | junk, min_size=0, max_size=3) | junk,
    },
) | junk | st.lists(junk, max_size=3)
headers = st.dictionaries(st.text(max_size=8), entry, max_size=5)


def _write(path, header_bytes: bytes, data_bytes: int, length: int | None) -> None:
    n = len(header_bytes) if length is None else length
    path.write_bytes(struct.pack("<Q", n % 2**64) + header_bytes + b"\0" * data_bytes)


@FUZZ
@given(header=headers, data_bytes=st.integers(0, 512),
       length=st.none() | st.integers(0, 2**64 - 1), raw=st.none() | st.binary(max_size=64),
       nesting=st.integers(0, 3))
def test_fuzz_safetensors_headers(tmp_path, header, data_bytes, length, raw, nesting):
    if raw is not None:
        body = raw
    else:
        body = json.dumps(header).encode()
        if nesting == 3:
            body = b"[" * 50000 + b"]" * 50000
    path = tmp_path / "model.safetensors"
    _write(path, body, data_bytes, length)
    first8 = str(int.from_bytes(path.read_bytes()[:8], "little"))
    try:
        out = read_safetensors_header(path)
    except ConfigError as e:
        text = str(e)
        assert text.strip() and "\n" not in text.strip()
        if length is not None and length > 64:
            # The file's own path is named in the message; its digits (pytest-343/) are not the
            # header's bytes, so they are taken out before looking for the length.
            assert first8 not in text.replace(str(path), "<file>")
        return
    # Accepted: every tensor lies within the data, with the size its dtype and shape imply.
    for name, info in out.items():
        assert isinstance(info["dtype"], str) and all(isinstance(d, int) and d >= 0 for d in info["shape"])
        begin, end = header[name]["data_offsets"]
        assert 0 <= begin <= end <= data_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("fuzz") / "tiny", "llama", shard_kb=40, seed=3)


names = (st.sampled_from(["../outside.safetensors", "/etc/passwd", "/proc/self/mem", "..", ".", "a/b",
                          "", "x\0y", "C:\\w.safetensors", "model.safetensors"])
         | st.text(max_size=12) | st.integers() | st.none() | st.lists(st.text(max_size=3), max_size=2))


@settings(FUZZ, max_examples=max(1, EXAMPLES // 3))  # each case copies a folder
@given(changes=st.dictionaries(st.integers(0, 40), names, max_size=4), extra_key=st.none() | st.integers())
def test_fuzz_index_files(tiny, tmp_path_factory, changes, extra_key):
    folder = tmp_path_factory.mktemp("case") / "tiny"
    shutil.copytree(tiny, folder)
    index = json.loads((folder / INDEX_FILE).read_text())
    keys = sorted(index["weight_map"])
    for i, name in changes.items():
        index["weight_map"][keys[i % len(keys)]] = name
    text = json.dumps(index)
    if extra_key is not None:
        text = text.replace('"weight_map": {', f'"weight_map": {{{extra_key}: "x", ', 1)  # a non-string key
    (folder / INDEX_FILE).write_text(text)
    try:
        found = inspect_pretrained(folder)
    except ConfigError as e:
        assert str(e).strip() and "root:" not in str(e)
        return
    for f in found.files:
        assert "/" not in f and "\\" not in f and f not in (".", "..")
        assert (folder / f).resolve().is_relative_to(folder.resolve())
