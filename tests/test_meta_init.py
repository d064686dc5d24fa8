"""Meta-device initialisation: the same weights as an eager build, shard by shard, in bounded memory."""

import math

import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.meta_init import is_meta_module, record_build
from shardwise.runtime.session import Session
from shardwise.testing import run_distributed
from tests.helpers.hf import meta_vs_eager
from tests.helpers.models import build_mlp, build_mlp_not_on_meta


def _factories():
    out = {"gpt-nano": lambda: GPT(GPT_PRESETS["nano"]), "custom-mlp": lambda: build_mlp(depth=3)}
    try:
        from shardwise.models.hf import build_hf_model
    except ImportError:  # pragma: no cover - transformers is in the test extras
        return out
    out["hf-llama-tiny"] = lambda: build_hf_model("llama-tiny")
    out["hf-gpt2-tiny"] = lambda: build_hf_model("gpt2-tiny")  # tied embeddings
    return out


@pytest.mark.parametrize("name", list(_factories()))
def test_replay_gives_the_eager_weights_and_rng(name):
    factory = _factories()[name]
    torch.manual_seed(11)
    eager = factory()
    eager_next = torch.rand(5)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    model, program = record_build(factory)
    assert is_meta_module(model) and torch.equal(torch.get_rng_state(), state)  # recording drew nothing...
    program.materialize(model, torch.device("cpu"))
    assert not is_meta_module(model)
    # ... the replay draws exactly what the eager build drew, so the stream continues identically.
    assert torch.equal(torch.rand(5), eager_next)
    want, got = eager.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    x = torch.randn(2, 12) if name == "custom-mlp" else torch.randint(0, 64, (2, 8))
    assert torch.equal(eager(x), model(x))
    if name == "hf-gpt2-tiny":  # tied weights stay one tensor
        assert model.hf.lm_head.weight is model.hf.transformer.wte.weight


def test_replay_holds_about_one_tensor_at_a_time():
    # lab: 10.7M parameters; its largest tensor is one 384 x 1536 MLP matrix (2.25 MiB).
    model, program = record_build(lambda: GPT(GPT_PRESETS["lab"]))
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(math.prod(p.shape) * 4 for p in model.parameters())
    program.materialize(model, torch.device("cpu"))
    assert 0 < program.peak_replay_bytes <= 2 * largest < model_bytes / 5


def test_session_build_falls_back_to_eager_with_a_note_and_refuses_foreign_meta_models():
    session = Session(strategy="single", seed=0)
    model = session.build(lambda: build_mlp_not_on_meta(depth=2))
    assert not is_meta_module(model)
    assert "cannot be built on the meta device" in session.notes[0] and "this factory needs real tensors" in \
        session.notes[0]
    session.close()
    session = Session(strategy="single", seed=0)
    with torch.device("meta"):
        foreign = build_mlp(depth=2)
    with pytest.raises(ShardwiseError, match=r"on the meta device but was not built by session.build"):
        session.prepare(foreign)
    with pytest.raises(Exception, match="init must be one of meta, eager"):
        session.build(build_mlp, init="lazy")
    session.close()


def test_trainer_meta_and_eager_runs_are_identical(tmp_path):
    from shardwise.core.config import load_config
    from shardwise.runtime.trainer import train

    losses = {}
    for init in ("meta", "eager"):
        cfg = load_config(None, ["model.preset=nano", "train.steps=3", "train.log_every=1", "train.eval_every=0",
                                 "train.eval_batches=1", "train.sample_tokens=0", "train.progress=false",
                                 "checkpoint.at_end=false", "parallel.strategy=single", f"model.init={init}"])
        summary = train(cfg, tmp_path / init)
        losses[init] = [line for line in (tmp_path / init / "metrics.jsonl").read_text().splitlines()
                        if '"loss"' in line]
        losses[init] = [__import__("json").loads(line)["loss"] for line in losses[init]]
        assert summary["steps"] == 3
    assert losses["meta"] == losses["eager"]


@pytest.mark.slow
def test_sharded_meta_init_equals_eager_and_keeps_the_ledger():
    pytest.importorskip("transformers")
    cases = [{"strategy": s, "kind": k, "options": o}
             for s, o in (("fsdp", {}), ("ddp", {}), ("fsdp+tp", {"tp": 2}), ("tp", {"tp": 2}),
                          ("fsdp-offload", {}), ("zero1", {}))
             for k in ("gpt", "llama-tiny")]
    cases += [{"strategy": "pp", "kind": "gpt", "options": {"pp": 2}},
              {"strategy": "fsdp+pp", "kind": "gpt", "options": {"pp": 2}}]
    results = run_distributed(meta_vs_eager, 2, timeout_s=600, cases=cases)
    for i, case in enumerate(cases):
        for rank in range(2):
            eager, meta = results[rank][i]["eager"], results[rank][i]["meta"]
            assert eager["params"].keys() == meta["params"].keys(), case
            for key in eager["params"]:
                assert torch.equal(eager["params"][key], meta["params"][key]), (case, rank, key)
            # The ledger's per-rank parameter bytes are what they were with the eager build.
            assert eager["param_bytes"] == meta["param_bytes"], (case, rank)
            assert torch.equal(eager["after"], meta["after"]), case


def test_a_model_materialised_in_parts_gets_the_eager_values():
    """A rank's pipeline stages under fsdp+pp are materialised one FSDP root at a time: every replay
    starts from the build's generator state, so the second part does not get the draws after the first."""
    from torch import nn

    def factory():
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    torch.manual_seed(0)
    eager = factory()
    after_eager = torch.rand(3)
    torch.manual_seed(0)
    model, program = record_build(factory)
    program.materialize(model[1], torch.device("cpu"), name_of=lambda n: f"1.{n}")
    program.materialize(model[0], torch.device("cpu"), name_of=lambda n: f"0.{n}")
    for (name, want), got in zip(eager.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    assert torch.equal(torch.rand(3), after_eager)  # the generator ends where the eager build leaves it
