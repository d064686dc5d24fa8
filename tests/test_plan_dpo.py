"""The planner plans preference tuning (``plan --objective dpo``, plan/preference.py).

A DPO micro-batch of B pairs is 2B sequences (chosen and rejected in one forward); a live reference
adds one forward without gradients (a third of a forward + backward) and, as a frozen copy, its
parameter shards once more; precomputed log-probs cost host bytes only. Layouts the DPO step refuses
(pipeline, context, expert parallel, DeepSpeed's engines) are never offered.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardwise.plan.advice import Cluster, Workload, evaluate, predict_step_time
from shardwise.plan.cost import CALIBRATIONS
from shardwise.plan.memory import Layout
from shardwise.plan.predict import predict_run
from shardwise.plan.preference import REFERENCE_FORWARD_SHARE
from shardwise.plan.presets import gpu, model_preset
from shardwise.plan.search import make_plan

H100 = CALIBRATIONS["h100"]


@pytest.fixture(scope="module")
def llama():
    return model_preset("llama-3-8b")


def test_dpo_candidate_is_the_lm_one_at_twice_the_sequences_plus_the_reference(llama):
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=1)
    layout = Layout("fsdp", dp=8)
    lm = Workload(seq=2048, micro_batch=2, grad_accum=1, checkpoint="full")
    doubled = evaluate(llama, cluster, dataclasses.replace(lm, micro_batch=4), layout, H100)
    by_ref = {ref: evaluate(llama, cluster, dataclasses.replace(lm, objective="dpo", dpo_reference=ref), layout, H100)
              for ref in ("copy", "adapters", "precomputed")}
    for ref, cand in by_ref.items():
        # Activations and transients are those of 4 sequences per micro-batch.
        assert cand.memory.activations == doubled.memory.activations, ref
        assert cand.memory.transient == doubled.memory.transient, ref
        assert cand.memory.optimizer == doubled.memory.optimizer and cand.memory.grads == doubled.memory.grads, ref
    assert by_ref["copy"].memory.params == 2 * doubled.memory.params  # the frozen copy's shards
    assert by_ref["adapters"].memory.params == doubled.memory.params
    assert by_ref["precomputed"].memory.params == doubled.memory.params
    # Time: the doubled sequences' step, the live reference's forward added to the compute term.
    base = predict_step_time(llama, cluster, dataclasses.replace(lm, micro_batch=4), layout, H100)
    assert by_ref["precomputed"].time.compute_s == pytest.approx(base.compute_s, rel=1e-12)
    for ref in ("copy", "adapters"):
        assert by_ref[ref].time.compute_s == pytest.approx(base.compute_s * (1 + REFERENCE_FORWARD_SHARE), rel=1e-12)
        assert by_ref[ref].time.comm_exposed_s == pytest.approx(base.comm_exposed_s, rel=1e-12)


def test_dpo_search_never_offers_a_layout_the_dpo_step_refuses(llama):
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=8, nodes=2)
    work = Workload(seq=4096, micro_batch=1, global_batch=64, objective="dpo", recipe="hf-dpo")
    # A pipeline takes its reference from adapters or precomputed log-probs, not from a frozen copy.
    plan = make_plan(llama, cluster, work, pp=2)
    assert all(c.layout.pp == 1 for c in plan.candidates)
    assert any("under pipeline parallel takes its reference" in line for line in plan.skipped)
    piped = make_plan(llama, cluster, dataclasses.replace(work, dpo_reference="precomputed"), pp=2)
    assert piped.candidates and all(c.layout.pp == 2 for c in piped.candidates)
    free = make_plan(llama, cluster, dataclasses.replace(work, objective="lm"))
    dpo = make_plan(llama, cluster, work)
    # Context (and, for MoE models, expert) parallel run under DPO: offered wherever the LM plan offers them.
    assert all(c.layout.pp == 1 for c in dpo.candidates)
    assert ({(c.layout.strategy, c.layout.tp, c.layout.cp) for c in dpo.candidates}
            == {(c.layout.strategy, c.layout.tp, c.layout.cp) for c in free.candidates if c.layout.pp == 1})
    long = make_plan(llama, cluster, work, cp=2)
    assert long.candidates and all(c.layout.cp == 2 for c in long.candidates)
    assert all("pipeline parallel" in line for line in long.skipped if "'dpo'" in line)
    assert dpo.recommended is not None and free.recommended is not None


def test_dry_run_prediction_doubles_the_sequences_and_notes_the_copy(llama):
    layout = Layout("fsdp", dp=8)
    args = dict(precision="bf16-mixed", seq=1024, micro_batch_size=2, activation_checkpointing="full")
    lm = predict_run(llama, layout, **{**args, "micro_batch_size": 4})
    dpo = predict_run(llama, layout, **args, dpo_reference="copy")
    assert [r.activation_bytes for r in dpo.ranks] == [r.activation_bytes for r in lm.ranks]
    assert [r.param_bytes for r in dpo.ranks] == [r.param_bytes for r in lm.ranks]  # the copy sits beside it
    assert any("frozen copy" in n for n in dpo.notes)


def test_plan_cli_picks_hf_dpo_for_preference_records(tmp_path, capsys):
    pytest.importorskip("transformers")
    import transformers

    from shardwise.cli import main

    cfg = transformers.AutoConfig.for_model("qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256)
    folder = tmp_path / "qwen"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" for _ in range(3)))
    assert main(["plan", "--pretrained", str(folder), "--data", str(data), "--gpus-per-node", "2",
                 "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "objective: dpo" in out and "shardwise train hf-dpo" in out
    assert main(["plan", "--pretrained", str(folder), "--objective", "dpo", "--dpo-reference", "precomputed",
                 "--gpus-per-node", "2", "--seq", "128"]) == 0
    assert "preference.precompute_reference=true" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3-8b", "--objective", "dpo"]) == 2
    assert "--objective dpo plans preference tuning of a pretrained model" in capsys.readouterr().err
