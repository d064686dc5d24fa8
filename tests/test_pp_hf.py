"""Pipeline parallel on pretrained Hugging Face Llama-family models (parallel/pipeline/hf.py).

A tiny 4-layer Llama saved with save_pretrained; every run is compared with plain transformers (+
peft for LoRA) on one process: the first loss equal, the losses of later steps and the weights
after them within float32 reduction-order noise (AdamW at lr=1e-2 amplifies it to ~1e-5 in weights).
"""

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.core.config import LoraConfig, ParallelConfig  # noqa: E402
from shardwise.core.layout import resolve_layout  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models.hf import build_hf_model  # noqa: E402
from shardwise.models.pretrained import hf_name  # noqa: E402
from shardwise.parallel.pipeline.pp import check_pp_model  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from tests.helpers.hf import VOCAB, hf_cases, reference_losses  # noqa: E402

RUN = {"steps": 3, "global_batch": 4, "seq": 16, "lr": 1e-2}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def save_llama(folder, layers: int = 4, seed: int = 1, **overrides):
    torch.manual_seed(seed)
    build_hf_model("llama-tiny", vocab_size=VOCAB, num_hidden_layers=layers, **overrides).hf.save_pretrained(
        str(folder), max_shard_size="60KB")  # several files: each rank reads only its stage's tensors
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("pp-hf") / "llama")


def _full_name(name: str) -> str:
    """A union parameter name as the plain transformers model's state dict has it."""
    return hf_name(name[len("hf."):])


def _assert_matches(ref: dict, ranks: list, what: str, lora: bool = False) -> None:
    r_last = ranks[-1]
    assert ranks[0]["losses"][0] == pytest.approx(ref["losses"][0], abs=1e-6), what  # step 1: same weights
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5), what
    merged = {}
    for r in ranks:
        merged.update(r["params"])
    ref_state = ref["state"]
    for name, value in merged.items():
        # peft keeps the wrapped layer as base_layer, as our names do.
        key = "base_model.model." + name[len("hf."):] if lora else _full_name(name)
        torch.testing.assert_close(value, ref_state[key], atol=1e-4, rtol=0, msg=f"{what}: {name}")
    assert r_last["notes"] == []


def cases_and_meta_init(rank: int, world_size: int, cases: list, meta_cases: list) -> tuple:
    """``hf_cases`` and ``meta_vs_eager`` in the same ranks (one spawn)."""
    from tests.helpers.hf import meta_vs_eager

    return hf_cases(rank, world_size, cases), meta_vs_eager(rank, world_size, meta_cases)


def test_llama_pipeline_schedules_and_lora_match_transformers(folder):
    """One spawn of 2 ranks: pp with 1F1B and with the zero-bubble ZBV (two stages per rank in a V),
    and LoRA adapters under pp; each equals one-process transformers / peft. Then a Llama from its
    config built on meta under pp and fsdp+pp equals the eager build, stage by stage."""
    cases = [
        {"folder": str(folder), "strategy": "pp", **RUN},
        {"folder": str(folder), "strategy": "pp", "pp_schedule": "zbv", "pp_stages_per_rank": 2, **RUN},
        {"folder": str(folder), "strategy": "pp", "lora": LORA, **RUN},
    ]
    meta_cases = [{"strategy": "pp", "kind": "llama-tiny", "options": {"pp": 2}},
                  {"strategy": "fsdp+pp", "kind": "llama-tiny", "options": {"pp": 2}}]
    ranks = run_distributed(cases_and_meta_init, 2, timeout_s=600, cases=cases, meta_cases=meta_cases)
    results = [r[0] for r in ranks]
    for rank_result in ranks:
        for case, pair in zip(meta_cases, rank_result[1]):
            eager, meta = pair["eager"], pair["meta"]
            assert eager["params"].keys() == meta["params"].keys(), case
            assert all(torch.equal(eager["params"][k], meta["params"][k]) for k in eager["params"]), case
            assert eager["param_bytes"] == meta["param_bytes"] and torch.equal(eager["after"], meta["after"])
    full = reference_losses(folder, **RUN)
    peft = reference_losses(folder, lora=LoraConfig(**LORA), seed=0, **RUN)
    (p0, z0, l0), (p1, z1, l1) = results
    _assert_matches(full, [p0, p1], "pp 1f1b")
    _assert_matches(full, [z0, z1], "pp zbv")
    _assert_matches(peft, [l0, l1], "pp lora", lora=True)
    # Each rank holds only its stage: 1F1B splits layers 0-1 | 2-3 with the embedding on rank 0 and
    # the norm + head on rank 1; ZBV puts stages 0 and 3 (embedding and head) on rank 0.
    assert {n.split(".")[3] for n in p0["params"] if ".layers." in n} == {"0", "1"}
    assert "hf.model.embed_tokens.weight" in p0["params"] and "hf.lm_head.weight" in p1["params"]
    assert "hf.lm_head.weight" not in p0["params"] and "hf.model.embed_tokens.weight" not in p1["params"]
    assert {n.split(".")[3] for n in z0["params"] if ".layers." in n} == {"0", "3"}
    assert "hf.lm_head.weight" in z0["params"] and "hf.model.embed_tokens.weight" in z0["params"]
    # LoRA: only the adapters train, and only this stage's.
    assert l0["in_optimizer"] and all(".lora_" in n and n.split(".")[3] in "01" for n in l0["in_optimizer"])


@pytest.mark.slow
def test_fsdp_pp_and_tp_pp_with_sequence_parallel_at_four_ranks_match_transformers(folder):
    """One spawn of 4 ranks: fsdp+pp (pp 2 x dp 2), then fsdp+tp+pp (pp 2 x tp 2) with sequence
    parallel, where the sequence shard crosses the stage boundary."""
    run = {**RUN, "steps": 2, "global_batch": 8}
    cases = [{"folder": str(folder), "strategy": "fsdp+pp", "pp": 2, **run},
             {"folder": str(folder), "strategy": "fsdp+tp+pp", "pp": 2, "tp": 2, "sequence_parallel": True, **run}]
    results = run_distributed(hf_cases, 4, timeout_s=600, cases=cases)
    ref = reference_losses(folder, **run)
    for i, what in enumerate(("fsdp+pp", "fsdp+tp+pp sp")):
        ranks = [r[i] for r in results]
        assert not any(isinstance(r, str) for r in ranks), ranks
        _assert_matches(ref, ranks, what)


def test_moe_families_are_cut_and_models_without_a_stage_split_are_refused():
    # Tied embeddings and GPT-2 are cut (tests/test_pp_ties.py), the MoE families too (their routers'
    # sums cross the boundary: tests/test_hf_moe.py); a model with no split is named.
    layout = resolve_layout(ParallelConfig(strategy="pp"), 2)
    check_pp_model(build_hf_model("mixtral-tiny"), layout)
    with pytest.raises(ConfigError, match="Sequential has no stage split"):
        check_pp_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), layout)


def pp_fsdp_pp_roundtrip(rank: int, world_size: int, folder: str, root: str) -> dict:
    """pp trains and saves -> fsdp (no pipeline) loads it, trains on, saves -> pp loads that."""
    from shardwise.runtime.session import Session
    from shardwise.testing import fixed_batches, train_fixed_batches
    from tests.helpers.hf import hf_case
    from tests.helpers.mp import full_params

    out = {"pp": hf_case(rank, world_size, folder, "pp", steps=2, ckpt_dir=f"{root}/pp")["params"]}
    for strategy, source, save in (("fsdp", "pp", "fsdp"), ("pp", "fsdp", "")):
        session = Session(parallel=ParallelConfig(strategy=strategy), seed=0)
        model = session.build(lambda: build_hf_model(pretrained=folder))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        model, opt = session.prepare(model, opt)
        session.load(f"{root}/{source}", model, opt)
        out[f"{strategy}_loaded"] = full_params(model)
        if save:
            train_fixed_batches(session, model, opt, fixed_batches(2, 4, 16, VOCAB))
            session.save(f"{root}/{save}", model, opt, step=4)
            out[strategy] = full_params(model)
        session.close()
    return out


def test_checkpoints_move_between_pp_and_no_pp_and_export_from_pp(folder, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.runtime.checkpoint.hf_export import export_hf

    r0, r1 = run_distributed(pp_fsdp_pp_roundtrip, 2, timeout_s=600, folder=str(folder), root=str(tmp_path))
    pp_saved = {**r0["pp"], **r1["pp"]}  # the two stages together: the whole model
    assert set(pp_saved) == set(r0["fsdp_loaded"])
    assert all(torch.equal(pp_saved[k], r0["fsdp_loaded"][k]) for k in pp_saved)
    pp_loaded = {**r0["pp_loaded"], **r1["pp_loaded"]}
    assert set(pp_loaded) == set(r0["fsdp"]) and all(torch.equal(pp_loaded[k], r0["fsdp"][k]) for k in pp_loaded)
    assert not all(torch.equal(pp_saved[k], r0["fsdp"][k]) for k in pp_saved)  # fsdp trained on
    # Export from the pipeline checkpoint: from_pretrained gives the weights (and logits) it saved.
    export_hf(tmp_path / "pp", tmp_path / "export")
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    state = got.state_dict()
    assert all(torch.equal(state[_full_name(k)], v) for k, v in pp_saved.items())
    want = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    want.load_state_dict({_full_name(k): v for k, v in pp_saved.items()})
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=x).logits, want(input_ids=x).logits, atol=0, rtol=0)


def test_405b_plan_offers_three_d_and_its_commands_pass_dry_run(capsys, tmp_path):
    """`plan --model llama-3-405b` on 64 x 8 H100 offers fitting fsdp+tp+pp layouts (the cost model
    ranks fsdp with context parallel first at 8k tokens); the recommended command and torchtitan's
    pinned 3-D layout both pass `train --dry-run` (every check, the meta model of all 126 layers,
    no rank started)."""
    import shlex

    from shardwise.cli import main
    from shardwise.plan import cli as plan_cli
    from tests.test_plan_grid import plan_args

    plan = plan_cli.build_plan(plan_args("--model", "llama-3-405b", "--gpu", "h100", "--gpus-per-node", "8",
                                         "--nodes", "64"))
    assert plan.recommended is not None and plan.recommended.fits
    three_d = [c for c in plan.candidates if c.layout.strategy == "fsdp+tp+pp" and c.fits]
    assert any(c.layout.tp == 8 and c.layout.pp > 1 for c in three_d)
    # torchtitan's published layout (FSDP 8 x TP 8 x PP 8) is a candidate, and fits with full AC.
    pinned = plan_cli.build_plan(plan_args("--model", "llama-3-405b", "--gpu", "h100", "--gpus-per-node", "8",
                                           "--nodes", "64", "--tp", "8", "--pp", "8", "--checkpoint", "full"))
    assert (pinned.recommended.layout.dp, pinned.recommended.layout.tp, pinned.recommended.layout.pp) == (8, 8, 8)
    for chosen in (plan, pinned):
        argv = shlex.split(chosen.commands[0].replace("$MASTER_ADDR", "127.0.0.1"))
        assert argv[:2] == ["shardwise", "train"]
        capsys.readouterr()
        assert main([*argv[1:], "--dry-run", "--out", str(tmp_path / "run")]) == 0
        assert "every check passed" in capsys.readouterr().out
