"""GPT-2 (Hugging Face, fused Conv1D q/k/v) under tensor parallel equals one process.

A tiny GPT-2 folder is made with save_pretrained (tied embedding/head, sharded files). One spawn of
2 gloo ranks runs ``tp`` (tp=2, meta and eager init) and ``fsdp+tp`` with sequence parallel (dp=1 x tp=2) from the
pretrained folder, 5 fp32 AdamW steps each, and ``tp`` from a random init (meta init replays the
fused c_attn into its q/k/v slices); each must equal the single-process run, whose first loss is
transformers' own. The tp run's checkpoint is exported with ``ckpt export --format hf`` and
reloaded with from_pretrained: the fused c_attn comes back and the logits equal the trained
model's.

Checkpoints hold the fused c_attn whatever the layout, so resume crosses layouts: in the same spawn
fsdp+tp and fsdp each train 3 steps and save; tp resumes the fsdp checkpoint, and (in this process)
a single process resumes the fsdp+tp one; both continue to step 5 on the uninterrupted run's losses
(the resume tests' 1e-5). A checkpoint in the earlier format (c_attn as q/k/v, written by a piece
that saves the slices) still resumes under tp and is refused under fsdp, naming the way out.

LoRA in the same spawn, on every GPT-2 projection (the fused c_attn, whose base layer and adapter B
are split into q/k/v under TP, c_proj and c_fc): tp=2 and fsdp+tp equal single-process peft (first
loss exactly, 5 steps' losses and the trained adapters); the tp run's adapter checkpoint (c_attn's
B saved fused, PEFT's (3 x hidden, r)) resumes under fsdp, and ``ckpt export --format peft`` gives a
folder ``PeftModel.from_pretrained`` loads with the trained model's logits.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt2_qkv import fuse_split_state
from shardwise.runtime.checkpoint.pieces import ModelPiece, OptimizerPiece
from shardwise.runtime.checkpoint.state import model_state, optimizer_state
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


class SlicedModelPiece(ModelPiece):
    """The model piece as shardwise wrote it before checkpoints held the fused c_attn (q/k/v slices)."""

    def state_dict(self) -> dict:
        return model_state(self.model, fused=False)


class SlicedOptimizerPiece(OptimizerPiece):
    def state_dict(self) -> dict:
        return optimizer_state(self.model, self.optimizer, fused=False)


def segment(rank: int, world_size: int, folder: str, strategy: str, steps: list[int], load: str = "",
            save: str = "", sliced: bool = False, **options: object) -> dict | str:
    """Train ``folder``'s GPT-2 under ``strategy`` on the fixed batches of ``steps`` (the STEPS run's),
    after loading checkpoint ``load`` if given, then save to ``save``; the losses, or the load's error.
    ``sliced``: save in the earlier format (c_attn as q/k/v)."""
    from shardwise.errors import CheckpointError
    from shardwise.models.hf import build_hf_model

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    try:
        model = session.build(lambda: build_hf_model(pretrained=folder))
        opt = torch.optim.AdamW(model.parameters(), lr=STEPS["lr"], weight_decay=0.0)
        model, opt = session.prepare(model, opt)
        if load:
            try:
                assert session.load(load, model, opt).step == steps[0]
            except CheckpointError as e:
                return str(e)
        data = fixed_batches(STEPS["steps"], STEPS["global_batch"], STEPS["seq"], VOCAB)
        losses = train_fixed_batches(session, model, opt, data, steps=range(steps[0], steps[1]))["losses"]
        if save:
            if sliced:
                session.checkpoint_pieces.update(model=SlicedModelPiece(model), optim=SlicedOptimizerPiece(model, opt))
            session.save(save, model, opt, step=steps[1])
        return {"losses": losses}
    finally:
        session.close()


def gpt2_cases(rank: int, world_size: int, cases: list[dict], segments: list[dict]) -> list:
    """The pretrained cases (``hf_cases``), the random-init ones, then the ``segment``s: one spawn."""
    pretrained = [c for c in cases if "folder" in c]
    return (hf_cases(rank, world_size, pretrained)
            + [random_case(rank, world_size, **c) for c in cases if "folder" not in c]
            + [segment(rank, world_size, **s) for s in segments])


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gpt2") / "gpt2", "gpt2", seed=5, shard_kb=40)


LORA = {"rank": 4, "alpha": 8.0, "targets": ["c_attn", "c_proj", "c_fc"]}
LORA_RUN = {**STEPS, "lr": 1e-2}


def test_gpt2_tp_and_fsdp_tp_match_one_process_and_export_reloads(gpt2_folder, tmp_path):
    from shardwise.core.config import LoraConfig
    from tests.helpers.hf import reference_losses

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
        # LoRA, c_attn included (its B split into q/k/v like its base); sequence parallel is refused with LoRA.
        {"folder": folder, "strategy": "tp", "tp": 2, "lora": LORA, "ckpt_dir": str(tmp_path / "lora"), **LORA_RUN},
        {"folder": folder, "strategy": "fsdp+tp", "tp": 2, "lora": LORA, **LORA_RUN},
        {"folder": folder, "strategy": "fsdp", "lora": LORA, "resume": True, "ckpt_dir": str(tmp_path / "lora")},
        {"strategy": "tp", "tp": 2, **STEPS},  # random init: last, as gpt2_cases runs them after the pretrained ones
    ]
    lora_cases = range(3, 6)
    random_ref = random_case(0, 1, "single", **STEPS)
    tp_ck, fsdp_ck, old_ck = (str(tmp_path / n) for n in ("fsdp_tp3", "fsdp3", "sliced3"))
    segments = [
        {"strategy": "fsdp+tp", "tp": 2, "steps": [0, 3], "save": tp_ck},
        {"strategy": "fsdp", "steps": [0, 3], "save": fsdp_ck},
        {"strategy": "tp", "tp": 2, "steps": [0, 3], "save": old_ck, "sliced": True},
        {"strategy": "tp", "tp": 2, "steps": [3, 5], "load": fsdp_ck},  # fsdp -> tp
        {"strategy": "tp", "tp": 2, "steps": [3, 5], "load": old_ck},  # the earlier format, under tp
        {"strategy": "fsdp", "steps": [3, 5], "load": old_ck},  # ... and refused without tp
    ]
    results = run_distributed(gpt2_cases, 2, timeout_s=300, cases=cases,
                              segments=[{"folder": folder, **s} for s in segments])
    seg = results[0][len(cases):]
    for first in seg[:3]:
        assert first["losses"] == pytest.approx(ref["losses"][:3], abs=LOSS_ATOL), first
    for resumed in seg[3:5]:  # fsdp -> tp, and the earlier q/k/v format under tp
        assert resumed["losses"] == pytest.approx(ref["losses"][3:], abs=LOSS_ATOL), resumed
    refused = seg[5]
    assert "stored c_attn as c_attn.q/k/v" in refused and "tp > 1" in refused and "--format hf" in refused, refused
    # fsdp+tp (2 ranks) -> one process without tp, in this process.
    assert segment(0, 1, folder, "single", [3, 5], load=tp_ck)["losses"] == pytest.approx(ref["losses"][3:],
                                                                                          abs=LOSS_ATOL)
    from shardwise.runtime.checkpoint.locate import resolve_checkpoint
    from shardwise.runtime.checkpoint.manifest import read_manifest

    for ck in (tp_ck, fsdp_ck):  # one format whatever the layout
        names = read_manifest(resolve_checkpoint(ck))["model_tensors"]
        assert "hf.transformer.h.0.attn.c_attn.weight" in names and not any(".c_attn.q." in n for n in names)
    for i, case in enumerate(cases):
        if i in lora_cases:
            continue
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
    # A checkpoint in the earlier format (q/k/v slices) exports as the fused one of the same 3 steps under fsdp.
    export_hf(old_ck, tmp_path / "export_sliced")
    export_hf(fsdp_ck, tmp_path / "export_fsdp")
    with torch.no_grad():
        torch.testing.assert_close(reference_model(tmp_path / "export_sliced")(input_ids=x).logits,
                                   reference_model(tmp_path / "export_fsdp")(input_ids=x).logits, atol=1e-4, rtol=0)

    peft_ref = reference_losses(gpt2_folder, lora=LoraConfig(**LORA), seed=0, **LORA_RUN)
    _assert_lora_matches_peft(peft_ref, [rank[i] for rank in results for i in lora_cases[:2]])
    tp_lora = fuse_split_state(results[0][lora_cases[0]]["params"])
    for rank in results:  # the tp checkpoint resumed under fsdp: the same adapters
        resumed = rank[lora_cases[2]]
        assert not isinstance(resumed, str), resumed
        assert resumed["step"] == LORA_RUN["steps"]
        for name, value in tp_lora.items():
            if ".lora_" in name:
                assert torch.equal(resumed["params"][name], value), name
    _assert_peft_export_loads(gpt2_folder, tmp_path / "lora", tp_lora, tmp_path / "adapter", x)


def _assert_lora_matches_peft(ref: dict, runs: list) -> None:
    """LoRA runs (tp, fsdp+tp) against single-process peft: first loss exactly, then the losses and weights."""
    for r in runs:
        assert not isinstance(r, str), r
        assert r["losses"][0] == pytest.approx(ref["losses"][0], abs=1e-6)
        assert r["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL)
        got = fuse_split_state(r["params"])
        assert "hf.transformer.h.0.attn.c_attn.lora_B.default.weight" in got  # c_attn's adapter trained, fused back
        for name, value in got.items():
            key = "base_model.model." + name[len("hf."):]  # peft's names: the wrapped layer as base_layer
            diff = (value - ref["state"][key]).abs().max().item()
            assert diff < PARAM_ATOL, (name, diff)
        assert r["in_optimizer"] == sorted(n for n in r["params"] if ".lora_" in n)
        assert any(".lora_B.default.q." in n for n in r["in_optimizer"])  # B trained as its q/k/v parts


def _assert_peft_export_loads(folder, ckpt, trained: dict, out, x: torch.Tensor) -> None:
    """``ckpt export --format peft`` of a tp LoRA checkpoint loads with PEFT and gives ``trained``'s logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from shardwise.core.config import LoraConfig
    from shardwise.models.hf import build_hf_model
    from shardwise.runtime.checkpoint.hf_export import export_peft

    export_peft(ckpt, out)
    saved = load_file(str(out / "adapter_model.safetensors"))
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"
    assert saved[key].shape == (3 * 64, LORA["rank"])  # PEFT's fused layout
    ours = build_hf_model(pretrained=str(folder), lora=LoraConfig(**LORA))
    assert not ours.load_state_dict(trained, strict=False).unexpected_keys
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(reference_model(folder), str(out)).eval()
        assert torch.equal(peft_model(input_ids=x).logits, ours.eval()(x))


def test_gpt2_tp_checks_heads_and_takes_lora_on_every_projection(gpt2_folder):
    from shardwise.core.config import LoraConfig
    from shardwise.errors import ConfigError
    from shardwise.models.hf import build_hf_model
    from shardwise.parallel.tensor.tp import check_tp_model

    with torch.device("meta"):
        model = build_hf_model(pretrained=str(gpt2_folder))
        lora = build_hf_model(pretrained=str(gpt2_folder), lora=LoraConfig(rank=4))  # peft's default: c_attn
    check_tp_model(model, 2)
    check_tp_model(lora, 2)
    with pytest.raises(ConfigError, match="n_head=4.*not divisible by 3"):
        check_tp_model(model, 3)


def test_checkpoint_names_fuse_and_cut_back():
    """Model and flattened optimizer entries of q/k/v fuse to c_attn's names and layout and back."""
    from shardwise.models.gpt2_qkv import fuse_shapes, split_names
    from shardwise.runtime.checkpoint.state import fuse_state, unfuse_state

    stem = "hf.transformer.h.0.attn.c_attn"
    parts = {p: torch.randn(8, 4) for p in "qkv"}
    split = {**{f"state.{stem}.{p}.weight.exp_avg": parts[p] for p in "qkv"},
             **{f"state.{stem}.{p}.weight.step": torch.tensor(3.0) for p in "qkv"},
             **{f"param_groups.{stem}.{p}.weight.lr": 1e-3 for p in "qkv"},
             f"{stem}.q.bias": torch.zeros(4), "hf.transformer.h.0.mlp.c_fc.weight": torch.ones(2)}
    assert set(split_names(split)) == {f"state.{stem}.weight.exp_avg", f"state.{stem}.weight.step",
                                       f"param_groups.{stem}.weight.lr"}  # a lone q.bias is no group
    fused = fuse_state(split)
    assert torch.equal(fused[f"state.{stem}.weight.exp_avg"], torch.cat([parts[p] for p in "qkv"], dim=-1))
    assert fused[f"state.{stem}.weight.step"].item() == 3.0 and fused[f"param_groups.{stem}.weight.lr"] == 1e-3
    assert f"{stem}.q.bias" in fused and "hf.transformer.h.0.mlp.c_fc.weight" in fused
    back = unfuse_state(fused, split)
    assert set(back) == set(split)
    for p in "qkv":
        assert torch.equal(back[f"state.{stem}.{p}.weight.exp_avg"], parts[p])
    steps = [back[f"state.{stem}.{p}.weight.step"] for p in "qkv"]
    assert len({id(s) for s in steps}) == 3  # Adam increments each in place: never one shared tensor
    with pytest.raises(ValueError, match="three parts"):
        unfuse_state({f"state.{stem}.weight.exp_avg": torch.zeros(8, 6)}, split)
    shapes = {f"{stem}.{p}.weight": [[64, 64], "float32"] for p in "qkv"}
    assert fuse_shapes(shapes) == {f"{stem}.weight": [[64, 192], "float32"]}
    # A LoRA B (nn.Linear, (out, r)) fuses along its first dim, as PEFT stores it; the base inside the wrapper
    # along its last.
    lora_b = {f"state.{stem}.lora_B.default.{p}.weight.exp_avg": torch.randn(8, 2) for p in "qkv"}
    base = {f"{stem}.base_layer.{p}.weight": torch.randn(4, 8) for p in "qkv"}
    fused = fuse_state({**lora_b, **base})
    assert fused[f"state.{stem}.lora_B.default.weight.exp_avg"].shape == (24, 2)
    assert fused[f"{stem}.base_layer.weight"].shape == (4, 24)
    back = unfuse_state(fused, {**lora_b, **base})
    assert all(torch.equal(back[n], v) for n, v in {**lora_b, **base}.items())
    assert fuse_shapes({f"{stem}.lora_B.default.{p}.weight": [[64, 4], "float32"] for p in "qkv"}) == {
        f"{stem}.lora_B.default.weight": [[192, 4], "float32"]}
