"""Session.save/load default to everything the session prepared."""

from __future__ import annotations

import json

import torch

from shardwise import Session


def _session_run(tmp_path, steps: int):
    s = Session()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, opt = s.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = [(torch.randn(4), torch.randn(2)) for _ in range(32)]
    loader = s.dataloader(data, 4)
    s.dataloader(data, 4, shuffle=False)  # an eval loader is not the one saved
    it = iter(loader)
    for _ in range(steps):
        x, y = s.to_device(next(it))
        s.backward(torch.nn.functional.mse_loss(model(x), y))
        s.step(opt)
    return s, model, opt, loader


def test_save_without_arguments_covers_optimizer_loader_and_step(tmp_path):
    s, model, opt, loader = _session_run(tmp_path, 3)
    try:
        path = s.save(tmp_path / "ckpt")  # no step=, optimizer= or loader=
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["step"] == 3 and manifest["has_optimizer"] is True
        assert manifest["data"] is not None and manifest["data"]["batch_in_epoch"] == 3
    finally:
        s.close()
    t, model2, opt2, loader2 = _session_run(tmp_path, 0)
    try:
        loaded = t.load(tmp_path / "ckpt")
        assert loaded.step == 3 and t.steps_taken == 3
        assert loader2.state_dict() == loader.state_dict()
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
        assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    finally:
        t.close()


def test_exported_weights_are_as_readable_as_any_file(tmp_path):
    import os

    from shardwise.runtime.checkpoint.export import export_weights

    s, *_ = _session_run(tmp_path, 1)
    try:
        s.save(tmp_path / "ckpt")
    finally:
        s.close()
    out = tmp_path / "w.safetensors"
    export_weights(tmp_path / "ckpt", out)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_deeply_nested_jsonl_record_is_refused(tmp_path):
    import pytest

    from shardwise.data.text import _jsonl_documents
    from shardwise.errors import ConfigError

    f = tmp_path / "deep.jsonl"
    f.write_text('{"text": "ok"}\n' + "[" * 100000 + "]" * 100000 + "\n")
    with pytest.raises(ConfigError, match="line 2 is nested too deeply"):
        list(_jsonl_documents(f, "text"))
