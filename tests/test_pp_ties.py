"""Pipeline parallel on models that tie their output head to the embedding (parallel/pipeline/ties.py) and on
GPT-2 (parallel/pipeline/gpt2.py), against one process of plain transformers.

Tiny pretrained folders made with save_pretrained (a 4-layer Llama with tie_word_embeddings = true,
a 2-layer GPT-2, which ties wte and lm_head). One spawn of 2 gloo ranks runs, fp32, AdamW at
lr=1e-2 with gradient clipping that bites (max_norm below the gradients' norm, so a tied tensor
counted twice in the norm would change every update):

* GPT-2 under pp (1F1B), 5 steps, and LoRA on it (peft's default c_attn; the tied weight frozen)
  against peft; the Llama under pp with ZBV (first and last stage on rank 0: the tie stays one
  tensor there), 5 steps; a randomly initialised GPT-2 built on meta (the last stage's head copy
  must start as the first stage's wte) against one process, 2 steps;
* the Llama under pp (1F1B) for 3 steps, saved; fsdp (no pipeline) resumes it, saves at once, and
  trains steps 4-5; pp resumes fsdp's checkpoint and trains steps 4-5. Each equals the one-process
  run: the first loss exactly, later losses, norms and weights within float32 reduction noise.

Then the pipeline checkpoint is exported with ``ckpt export --format hf``: from_pretrained gives a
tied model with the weights the two stages saved, and equal logits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.core.config import LoraConfig, ParallelConfig  # noqa: E402
from shardwise.core.layout import resolve_layout  # noqa: E402
from shardwise.models.gpt2_qkv import fuse_split_state  # noqa: E402
from shardwise.models.hf import build_hf_model  # noqa: E402
from shardwise.parallel.pipeline.pp import check_pp_model  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from tests.helpers.hf import VOCAB, reference_losses, save_tiny  # noqa: E402
from tests.test_pp_hf import _full_name, save_llama  # noqa: E402

RUN = {"steps": 5, "global_batch": 4, "seq": 16, "lr": 1e-2}
MAX_NORM = 0.5  # below every step's gradient norm here: clipping scales every update
# AdamW at lr=1e-2 turns float32 reduction-order noise on near-zero gradient elements into weight
# differences: measured at most 1.0e-4 after 5 steps (fsdp+pp, an o_proj element), against ~5e-2 of
# total movement; a tied copy that trained apart would be off by ~1e-2.
PARAM_ATOL = 3e-4
LORA = {"rank": 4, "alpha": 8.0}  # peft's GPT-2 default targets: c_attn (the tied wte/lm_head stay frozen)


def _train(folder: str, strategy: str, steps: range, load: str = "", save_loaded: str = "", save: str = "",
           global_batch: int = RUN["global_batch"], lora: dict | None = None, **options: object) -> dict:
    """Build ``folder`` (meta init; a preset name such as "gpt2-tiny": a random init from its config)
    under ``strategy``, optionally resume ``load`` (and save that state again to ``save_loaded``), train
    ``steps`` of the fixed batches with clipping, optionally save."""
    from shardwise.runtime.session import Session
    from shardwise.testing import fixed_batches, train_fixed_batches
    from tests.helpers.mp import full_params

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    settings = LoraConfig(**lora) if lora else None
    if folder.endswith("-tiny"):
        model = session.build(lambda: build_hf_model(folder, vocab_size=VOCAB), init="meta")
    else:
        model = session.build(lambda: build_hf_model(pretrained=folder, lora=settings), init="meta")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=RUN["lr"], weight_decay=0.0)
    model, opt = session.prepare(model, opt)
    if load:
        session.load(load, model, opt)
    if save_loaded:
        session.save(save_loaded, model, opt, step=steps.start)
    data = fixed_batches(RUN["steps"], global_batch, RUN["seq"], VOCAB)
    out = train_fixed_batches(session, model, opt, data, steps=steps, max_norm=MAX_NORM)
    if save:
        session.save(save, model, opt, step=steps.stop)
    out["params"] = full_params(model)
    session.close()
    return out


def tied_pp_runs(rank: int, world_size: int, llama: str, gpt2: str, root: str) -> dict:
    return {
        "gpt2": _train(gpt2, "pp", range(5)),
        "gpt2_lora": _train(gpt2, "pp", range(5), lora=LORA),
        # A random init on meta: each stage replays its own parts' init; the head copy must get wte's.
        "random": _train("gpt2-tiny", "pp", range(2)),
        "zbv": _train(llama, "pp", range(5), pp_schedule="zbv", pp_stages_per_rank=2),
        "pp": _train(llama, "pp", range(3), save=f"{root}/pp"),
        "fsdp": _train(llama, "fsdp", range(3, 5), load=f"{root}/pp", save_loaded=f"{root}/fsdp"),
        "pp_resumed": _train(llama, "pp", range(3, 5), load=f"{root}/fsdp"),
    }


def _assert_equal_to(ref: dict, ranks: list[dict], what: str, steps: range, lora: bool = False) -> None:
    for r in ranks:
        if steps.start == 0:  # the same weights: the same first loss
            assert r["losses"][0] == pytest.approx(ref["losses"][0], abs=1e-6), what
        assert r["losses"] == pytest.approx(ref["losses"][steps.start:steps.stop], abs=1e-5), what
        assert r["norms"] == pytest.approx(ref["norms"][steps.start:steps.stop], rel=1e-4), what
    merged: dict = {}
    for r in ranks:
        merged.update(r["params"])
    for name, value in fuse_split_state(merged).items():  # GPT-2's c_attn as TP trains it: q/k/v
        # peft keeps the wrapped layer as base_layer, as our names do.
        key = "base_model.model." + name[len("hf."):] if lora else _full_name(name)
        diff = (value - ref["state"][key]).abs().max().item()
        assert diff < PARAM_ATOL, (what, name, diff)


def test_tied_llama_and_gpt2_under_pp_match_one_process_resume_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.runtime.checkpoint.hf_export import export_hf

    llama = save_llama(tmp_path / "llama", tie_word_embeddings=True)
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2", shard_kb=40)
    r0, r1 = run_distributed(tied_pp_runs, 2, timeout_s=900, llama=str(llama), gpt2=str(gpt2), root=str(tmp_path))
    one = _train("gpt2-tiny", "single", range(2))  # the same random init, one process
    for r in (r0["random"], r1["random"]):
        assert r["losses"][0] == pytest.approx(one["losses"][0], abs=1e-6)
        assert r["losses"] == pytest.approx(one["losses"], abs=1e-5)
    ref_llama = reference_losses(llama, max_norm=MAX_NORM, **RUN)
    ref_gpt2 = reference_losses(gpt2, max_norm=MAX_NORM, **RUN)
    assert all(n > MAX_NORM for n in ref_llama["norms"] + ref_gpt2["norms"])  # the clipping bites
    _assert_equal_to(ref_gpt2, [r0["gpt2"], r1["gpt2"]], "gpt2 pp", range(5))
    peft = reference_losses(gpt2, lora=LoraConfig(**LORA), max_norm=MAX_NORM, **RUN)
    _assert_equal_to(peft, [r0["gpt2_lora"], r1["gpt2_lora"]], "gpt2 pp lora", range(5), lora=True)
    _assert_equal_to(ref_llama, [r0["zbv"], r1["zbv"]], "llama pp zbv", range(5))
    # The 3-step pipeline run equals the first 3 reference steps (its weights are checked through the
    # resumed runs, which continue from them to the reference's step 5).
    for r in (r0["pp"], r1["pp"]):
        assert r["losses"] == pytest.approx(ref_llama["losses"][:3], abs=1e-5)
    _assert_equal_to(ref_llama, [r0["fsdp"]], "pp -> fsdp resume", range(3, 5))
    _assert_equal_to(ref_llama, [r0["pp_resumed"], r1["pp_resumed"]], "fsdp -> pp resume", range(3, 5))
    # Each stage holds its own copy of the tied tensor: the embedding on rank 0, the head on rank 1;
    # under ZBV rank 0 holds both stages, and one tensor.
    assert "hf.model.embed_tokens.weight" in r0["pp"]["params"] and "hf.lm_head.weight" in r1["pp"]["params"]
    assert "hf.transformer.wte.weight" in r0["gpt2"]["params"] and "hf.lm_head.weight" in r1["gpt2"]["params"]
    # Export from the pipeline checkpoint (step 3): a tied model with the saved weights, equal logits.
    export_hf(tmp_path / "pp", tmp_path / "export")
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    assert got.lm_head.weight is got.model.embed_tokens.weight
    saved = {**r0["pp"]["params"], **r1["pp"]["params"]}
    state = got.state_dict()
    assert all(torch.equal(state[_full_name(k)], v) for k, v in saved.items())
    want = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    want.load_state_dict({_full_name(k): v for k, v in saved.items()}, strict=False)
    want.tie_weights()
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=x).logits, want(input_ids=x).logits, atol=0, rtol=0)


def test_tied_weights_refused_where_data_parallel_would_wrap_one_tensor_twice(tmp_path):
    tied = build_hf_model("llama-tiny", vocab_size=VOCAB, num_hidden_layers=4, tie_word_embeddings=True)
    zbv = {"pp_schedule": "zbv", "pp_stages_per_rank": 2}
    check_pp_model(tied, resolve_layout(ParallelConfig(strategy="pp", **zbv), 2))  # one tensor on rank 0: exact
    check_pp_model(tied, resolve_layout(ParallelConfig(strategy="fsdp+pp", pp=2), 4))  # one copy per stage
    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError, match="puts the first and the last pipeline stage on one rank"):
        check_pp_model(tied, resolve_layout(ParallelConfig(strategy="fsdp+pp", pp=2, **zbv), 2))


def four_rank_runs(rank: int, world_size: int, llama: str, gpt2: str, root: str) -> list:
    run = {"global_batch": 8}
    return [_train(llama, "fsdp+pp", range(5), pp=2, **run),
            _train(gpt2, "ddp+pp", range(5), pp=2, **run),
            _train(gpt2, "fsdp+tp+pp", range(5), pp=2, tp=2, sequence_parallel=True, **run),
            # The copies as FSDP shards in a checkpoint: fsdp+pp -> fsdp (dp 4) -> fsdp+pp.
            _train(llama, "fsdp+pp", range(3), pp=2, save=f"{root}/a", **run),
            _train(llama, "fsdp", range(3, 5), load=f"{root}/a", save_loaded=f"{root}/b", **run),
            _train(llama, "fsdp+pp", range(3, 5), pp=2, load=f"{root}/b", **run)]


@pytest.mark.slow
def test_tied_weights_under_fsdp_pp_ddp_pp_and_fsdp_tp_pp_at_four_ranks(tmp_path):
    """One spawn of 4 ranks: the tied Llama under fsdp+pp (pp 2 x dp 2: the copies' gradients are
    FSDP shards, summed shard by shard), GPT-2 under ddp+pp (pp 2 x dp 2) and under fsdp+tp+pp
    (pp 2 x tp 2, sequence parallel: vocabulary-parallel wte and head, both Shard(0)); then the tied
    Llama's fsdp+pp checkpoint (both copies' FSDP shards, the copy's optimizer state under the
    embedding's name) resumes under fsdp at dp 4 and back."""
    llama = save_llama(tmp_path / "llama", tie_word_embeddings=True)
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2")
    ranks = run_distributed(four_rank_runs, 4, timeout_s=900, llama=str(llama), gpt2=str(gpt2), root=str(tmp_path))
    run = {**RUN, "global_batch": 8}
    refs = [reference_losses(llama, max_norm=MAX_NORM, **run), reference_losses(gpt2, max_norm=MAX_NORM, **run)]
    cases = ((refs[0], "llama fsdp+pp"), (refs[1], "gpt2 ddp+pp"), (refs[1], "gpt2 fsdp+tp+pp"))
    for i, (ref, what) in enumerate(cases):
        _assert_equal_to(ref, [r[i] for r in ranks], what, range(5))
    for r in ranks:
        assert r[3]["losses"] == pytest.approx(refs[0]["losses"][:3], abs=1e-5)
    _assert_equal_to(refs[0], [r[4] for r in ranks], "fsdp+pp -> fsdp resume", range(3, 5))
    _assert_equal_to(refs[0], [r[5] for r in ranks], "fsdp -> fsdp+pp resume", range(3, 5))


def eight_rank_runs(rank: int, world_size: int, llama: str, gpt2: str) -> list:
    run = {"global_batch": 8}
    return [_train(llama, "fsdp+tp+pp", range(5), pp=2, tp=2, **run),
            _train(gpt2, "fsdp+tp+pp", range(5), pp=2, tp=2, sequence_parallel=True, **run),
            _train(gpt2, "fsdp+tp+pp", range(5), pp=2, tp=2, lora=LORA_EVERYWHERE, **run)]


# LoRA on every GPT-2 projection: the fused c_attn's adapter is split into q/k/v under TP.
LORA_EVERYWHERE = {"rank": 4, "alpha": 8.0, "targets": ["c_attn", "c_proj", "c_fc"]}


@pytest.mark.slow
@pytest.mark.skipif(__import__("os").environ.get("SHARDWISE_EIGHT_RANKS") != "1",
                    reason="8 gloo processes: too slow for CI on 2 cores; SHARDWISE_EIGHT_RANKS=1 runs it")
def test_tied_models_under_fsdp_tp_pp_at_eight_ranks(tmp_path):
    """One spawn of 8 ranks, dp 2 x tp 2 x pp 2 (torchtitan's 3-D order): the tied Llama (the copies'
    gradients are FSDP shards of vocabulary-parallel DTensors, summed over the first/last stage pair of
    each (dp, tp) coordinate), GPT-2 with sequence parallel, and GPT-2 with LoRA on every projection
    (c_attn's adapter split into q/k/v) against peft; each equals one process, 5 clipped steps."""
    llama = save_llama(tmp_path / "llama", tie_word_embeddings=True)
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2")
    ranks = run_distributed(eight_rank_runs, 8, timeout_s=1500, llama=str(llama), gpt2=str(gpt2))
    run = {**RUN, "global_batch": 8}
    refs = [reference_losses(llama, max_norm=MAX_NORM, **run), reference_losses(gpt2, max_norm=MAX_NORM, **run),
            reference_losses(gpt2, max_norm=MAX_NORM, lora=LoraConfig(**LORA_EVERYWHERE), **run)]
    for i, what in enumerate(("llama fsdp+tp+pp", "gpt2 fsdp+tp+pp", "gpt2 lora fsdp+tp+pp")):
        _assert_equal_to(refs[i], [r[i] for r in ranks], what, range(5), lora=i == 2)


def test_tied_llama_at_eight_ranks_passes_the_dry_run_and_a_v_schedule_is_refused(capsys, tmp_path):
    """``train --dry-run`` of a tied Llama at dp 2 x tp 2 x pp 2: every check and the meta model pass (the
    8-process run is test_tied_models_under_fsdp_tp_pp_at_eight_ranks); ZBV, which would put both tied
    copies on one FSDP-wrapped rank, is refused before any rank starts."""
    from shardwise.cli import main

    argv = ["train", "hf-shakespeare", "--dry-run", "--nproc", "8", "--strategy", "fsdp+tp+pp",
            "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "model.hf_config=llama-tiny",
            "--set", "model.overrides.tie_word_embeddings=true", "--set", "model.overrides.num_hidden_layers=4",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh pp=2 x dp=2 x tp=2" in out and "stage layers: 0-1 | 2-3" in out
    assert main([*argv, "--set", "parallel.pp_schedule=zbv", "--set", "parallel.pp_stages_per_rank=2"]) == 2
    assert "puts the first and the last pipeline stage on one rank" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
