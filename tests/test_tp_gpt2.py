"""GPT-2 (Hugging Face, fused Conv1D q/k/v) under tensor parallel equals one process.

A tiny GPT-2 folder is made with save_pretrained (tied embedding/head, sharded files). One spawn of
2 gloo ranks runs ``tp`` (tp=2, meta and eager init) and ``fsdp+tp`` with sequence parallel (dp=1 x tp=2) from the
pretrained folder, 5 fp32 AdamW steps each, and ``tp`` from a random init (meta init replays the
fused c_attn into its q/k/v slices); each must equal the single-process run, whose first loss is
transformers' own. The tp run's checkpoint is exported with ``ckpt export --format hf`` and
reloaded with from_pretrained: the fused c_attn comes back and the logits equal the trained
model's. Resuming that checkpoint under fsdp (fused c_attn) is refused, naming the way out.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ParallelConfig
from shardwise.parallel.tp_gpt2 import fuse_split_state
from shardwise.runtime.session import Session
from shardwise.testing import fixed_batches, lm_loss, run_distributed, train_fixed_batches
from tests.helpers.hf import VOCAB, hf_case, hf_cases, reference_model, save_tiny
from tests.helpers.mp import full_params

STEPS = {"steps": 5, "global_batch": 4, "seq": 16, "lr": 1e-3}
LOSS_ATOL = 1e-5
# AdamW divides each gradient element by its own running RMS, so an element whose true gradient is
# ~0 turns summation-order noise into a step of order lr: GPT-2's key bias gets exactly zero gradient
# (softmax ignores a per-query constant) and near-dead GELU units almost none. Measured at lr=1e-3 over
# 5 steps: at most 2e-5 on such elements (1e-6 elsewhere), against up to 5e-3 of total movement.
PARAM_ATOL = 5e-5


def _assert_parity(ref: dict, got: dict, case: object) -> None:
    assert not isinstance(got, str), got
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) < LOSS_ATOL, (case, step, a, b)
    want, have = fuse_split_state(ref["params"]), fuse_split_state(got["params"])
    assert set(want) == set(have), case
    for name in want:
        diff = (want[name] - have[name]).abs().max().item()
        assert diff < PARAM_ATOL, (case, name, diff)


def random_case(rank: int, world_size: int, strategy: str, steps: int, global_batch: int, seq: int,
                lr: float, **options: object) -> dict:
    """A randomly initialised tiny GPT-2 built on meta (its fused c_attn replayed into q/k/v), trained."""
    from shardwise.models.hf import build_hf_model

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    model = session.build(lambda: build_hf_model("gpt2-tiny", vocab_size=VOCAB), init="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model, opt = session.prepare(model, opt)
    losses = train_fixed_batches(session, model, opt, fixed_batches(steps, global_batch, seq, VOCAB))["losses"]
    result = {"losses": losses, "params": full_params(model), "notes": list(session.notes)}
    session.close()
    return result


def load_under(rank: int, world_size: int, folder: str, ckpt_dir: str, strategy: str) -> str:
    """Load a checkpoint into the model built under ``strategy``; the error message, or "loaded"."""
    from shardwise.errors import CheckpointError
    from shardwise.models.hf import build_hf_model

    session = Session(parallel=ParallelConfig(strategy=strategy), seed=0)  # type: ignore[arg-type]
    model = session.build(lambda: build_hf_model(pretrained=folder))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = session.prepare(model, opt)
    try:
        session.load(ckpt_dir, model, opt)
        return "loaded"
    except CheckpointError as e:
        return str(e)
    finally:
        session.close()


def gpt2_cases(rank: int, world_size: int, cases: list[dict], load: dict) -> list:
    """The pretrained cases (``hf_cases``), the random-init ones, then ``load_under(**load)``: one spawn."""
    pretrained = [c for c in cases if "folder" in c]
    return (hf_cases(rank, world_size, pretrained)
            + [random_case(rank, world_size, **c) for c in cases if "folder" not in c]
            + [load_under(rank, world_size, **load)])


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gpt2") / "gpt2", "gpt2", seed=5, shard_kb=40)


def test_gpt2_tp_and_fsdp_tp_match_one_process_and_export_reloads(gpt2_folder, tmp_path):
    folder = str(gpt2_folder)
    ref = hf_case(0, 1, folder, "single", **STEPS)
    x = fixed_batches(1, STEPS["global_batch"], STEPS["seq"], VOCAB)[0]
    with torch.no_grad():
        first = float(lm_loss(reference_model(gpt2_folder)(input_ids=x[:, :-1]).logits, x[:, 1:]))
    assert ref["losses"][0] == pytest.approx(first, abs=1e-6)
    ckpt = tmp_path / "ckpt"
    cases = [
        {"folder": folder, "strategy": "tp", "tp": 2, "ckpt_dir": str(ckpt), **STEPS},
        {"folder": folder, "strategy": "fsdp+tp", "tp": 2, "sequence_parallel": True, **STEPS},
        # Built whole first: the plan's tied wte/lm_head must stay one tensor (it used to train as two).
        {"folder": folder, "strategy": "tp", "tp": 2, "init": "eager", **STEPS},
        {"strategy": "tp", "tp": 2, **STEPS},
    ]
    random_ref = random_case(0, 1, "single", **STEPS)
    load = {"folder": folder, "ckpt_dir": str(ckpt), "strategy": "fsdp"}
    results = run_distributed(gpt2_cases, 2, timeout_s=300, cases=cases, load=load)
    # The TP checkpoint names c_attn's parts: resuming it without TP is refused with the way out.
    assert "holds c_attn as c_attn.q/k/v" in results[0][-1] and "--format hf" in results[0][-1], results[0][-1]
    for i, case in enumerate(cases):
        want = ref if "folder" in case else random_ref
        for rank in results:
            _assert_parity(want, rank[i], case["strategy"])
            assert rank[i]["notes"] == []  # built on meta as asked, no eager fallback
    for i in (0, 1):  # the q/k/v, c_fc and c_proj matrices are really split: each rank holds about half
        assert results[0][i]["param_bytes"] < 0.7 * sum(p.numel() * 4 for p in ref["params"].values())

    from shardwise.runtime.checkpoint.hf_export import export_hf

    out = tmp_path / "export"
    export_hf(ckpt, out)
    reloaded = reference_model(out)
    assert "transformer.h.0.attn.c_attn.weight" in dict(reloaded.named_parameters())
    trained = reference_model(gpt2_folder)
    tp_params = results[0][0]["params"]
    assert "hf.transformer.h.0.attn.c_attn.q.weight" in tp_params  # trained as q/k/v under TP
    loaded = trained.load_state_dict(fuse_split_state({k.removeprefix("hf."): v for k, v in tp_params.items()}),
                                     strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied to wte
    assert not torch.equal(trained.lm_head.weight, reference_model(gpt2_folder).lm_head.weight)  # it trained
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, trained(input_ids=x).logits, atol=1e-5, rtol=0)


def test_gpt2_tp_checks_heads_and_refuses_lora(gpt2_folder):
    from shardwise.config import LoraConfig
    from shardwise.errors import ConfigError
    from shardwise.models.hf import build_hf_model
    from shardwise.parallel.tp import check_tp_model

    with torch.device("meta"):
        model = build_hf_model(pretrained=str(gpt2_folder))
        lora = build_hf_model(pretrained=str(gpt2_folder), lora=LoraConfig(rank=4, targets=["c_attn"]))
    check_tp_model(model, 2)
    with pytest.raises(ConfigError, match="n_head=4.*not divisible by 3"):
        check_tp_model(model, 3)
    with pytest.raises(ConfigError, match="LoRA on a GPT-2 model is not supported"):
        check_tp_model(lora, 2)
