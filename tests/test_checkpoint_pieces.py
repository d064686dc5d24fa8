"""Checkpoint state is a dict of Stateful pieces: adding one is one entry."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise import Session
from shardwise.errors import CheckpointError, ShardwiseError
from shardwise.runtime.checkpoint.pieces import ManifestPiece, RankPiece, TensorPiece


class Ema(TensorPiece):
    """An exponential moving average of the weights: tensors, saved and resharded by DCP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)


class Counter(ManifestPiece):
    """Job-wide JSON data (kept in manifest.json)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not isinstance(state.get("n"), int):
            raise ValueError("'n' is not an integer")
        self.n = state["n"]


class RankTag(RankPiece):
    """Per-rank JSON data (kept in rng-rank<r>.json)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def state_dict(self) -> dict[str, str]:
        return {"tag": self.tag}

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.tag = state["tag"]


def _session(steps: int):
    s = Session()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, opt = s.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = [(torch.randn(4), torch.randn(2)) for _ in range(16)]
    it = iter(s.dataloader(data, 4))
    for _ in range(steps):
        x, y = s.to_device(next(it))
        s.backward(torch.nn.functional.mse_loss(model(x), y))
        s.step(opt)
    return s, model


def test_a_piece_is_one_entry_and_lands_where_its_kind_says(tmp_path):
    s, model = _session(2)
    try:
        ema = Ema(model)
        for v in ema.shadow.values():
            v.mul_(0.5)
        s.checkpoint_pieces.update(ema=ema, counter=Counter(7), tag=RankTag("r0"))
        path = s.save(tmp_path / "ckpt")
    finally:
        s.close()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["counter"] == {"n": 7}
    # Today's keys are all still there: older readers and older checkpoints agree.
    assert {"data", "scheduler", "state", "has_optimizer", "model_tensors"} <= set(manifest)
    assert json.loads((path / "rng-rank0.json").read_text())["tag"] == {"tag": "r0"}

    t, model2 = _session(0)
    try:
        ema2, counter, tag = Ema(model2), Counter(), RankTag()
        t.checkpoint_pieces.update(ema=ema2, counter=counter, tag=tag)
        loaded = t.load(tmp_path / "ckpt")
        assert loaded.step == 2 and counter.n == 7 and tag.tag == "r0"
        assert all(torch.equal(ema.shadow[k], ema2.shadow[k]) for k in ema.shadow)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
        # A checkpoint without a piece (saved before it was added) loads: the piece keeps its state.
        later_ema = Ema(model2)
        for v in later_ema.shadow.values():
            v.fill_(3.0)
        t.checkpoint_pieces.update(later=Counter(3), later_ema=later_ema)
        t.load(tmp_path / "ckpt")
        assert t.checkpoint_pieces["later"].n == 3
        assert all(bool((v == 3.0).all()) for v in later_ema.shadow.values())
    finally:
        t.close()


def test_bad_pieces_and_bad_piece_state_get_clear_errors(tmp_path):
    s, _ = _session(1)
    try:
        s.checkpoint_pieces["step"] = Counter()  # would overwrite the manifest's own 'step'
        with pytest.raises(ShardwiseError, match="'step' would overwrite the manifest"):
            s.save(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()  # refused before anything was written
        s.checkpoint_pieces.clear()
        s.checkpoint_pieces["plain"] = object()
        with pytest.raises(ShardwiseError, match="derives from TensorPiece, ManifestPiece or RankPiece"):
            s.save(tmp_path / "ckpt")
        s.checkpoint_pieces.clear()
        with pytest.raises(ShardwiseError, match="state is not JSON data"):
            s.save(tmp_path / "ckpt", state={"x": object()})
        s.checkpoint_pieces["counter"] = Counter("seven")  # type: ignore[arg-type]
        s.save(tmp_path / "ckpt")
        with pytest.raises(CheckpointError, match="cannot restore 'counter' from .*'n' is not an integer"):
            s.load(tmp_path / "ckpt")
    finally:
        s.close()
