"""DPO in one process: the loss equals a hand computation from per-token log-probs (TRL's own
DPOTrainer is run beside it in test_preference_trl.py), prompt tokens never count, packed and
concatenated batches give the same log-probs, the LoRA reference (adapters off) equals the frozen
base, the precomputed reference trains exactly as the live one, bad records are refused with their
location, and the truncation keeps the prompt's end and the answers' start."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from shardwise.core.config import PreferenceConfig, load_config  # noqa: E402
from shardwise.data.preference import PairRenderer, Pairs, encode_pairs, fit_pair, load_pairs  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.preference.batches import PairCollator, PairSet  # noqa: E402
from shardwise.preference.objective import answer_lengths, answer_logps, pair_halves, preference_losses  # noqa: E402
from tests.helpers.preference import dpo_overrides, preference_records, write_jsonl  # noqa: E402
from tests.helpers.sft import save_qwen2  # noqa: E402


def _pairs(lengths, seed=0, vocab=50):
    rng = np.random.default_rng(seed)
    p = Pairs([], [], [])
    for lp, lc, lr in lengths:
        p.prompts.append(rng.integers(1, vocab, lp))
        p.chosen.append(rng.integers(1, vocab, lc))
        p.rejected.append(rng.integers(1, vocab, lr))
    return p


def _hand_logps(logits, ids_rows, prompt_len):
    """Sum over answer tokens of log softmax(logits[t-1])[ids[t]], written out token by token."""
    out = []
    for row, ids in enumerate(ids_rows):
        lsm = torch.log_softmax(logits[row].double(), -1)
        out.append(sum(float(lsm[t - 1, ids[t]]) for t in range(prompt_len[row], len(ids))))
    return out


def test_dpo_loss_of_a_batch_equals_a_hand_computation():
    pairs = _pairs([(3, 4, 2), (1, 5, 5), (4, 2, 6)])
    x, y = PairCollator(pad_id=0)([PairSet(pairs)[i] for i in range(3)])
    torch.manual_seed(0)
    logits = torch.randn(*x["input_ids"].shape, 50, dtype=torch.float64)
    sums, counts = answer_logps(logits, y["labels"], y["segments"], 6)
    rows = [np.concatenate([pairs.prompts[i], a[i]]) for a in (pairs.chosen, pairs.rejected) for i in range(3)]
    hand = _hand_logps(logits, rows, [len(pairs.prompts[i]) for i in range(3)] * 2)
    torch.testing.assert_close(sums, torch.tensor(hand, dtype=torch.float64))
    assert counts.tolist() == [4, 5, 2, 2, 5, 6]  # every answer token, prompt tokens none
    assert answer_lengths(y["labels"], y["segments"], 6).tolist() == counts.tolist()
    ref_c, ref_r = torch.tensor([-3.0, -9.0, -1.5], dtype=torch.float64), torch.tensor([-4.0, -2.0, -8.0],
                                                                                        dtype=torch.float64)
    pc, pr = pair_halves(sums)
    beta, eps = 0.3, 0.1
    losses, rc, rr = preference_losses(pc, pr, ref_c, ref_r, beta=beta, label_smoothing=eps)
    for i in range(3):
        z = (hand[i] - hand[3 + i]) - (float(ref_c[i]) - float(ref_r[i]))
        sig = 1 / (1 + math.exp(-beta * z))
        expect = -(1 - eps) * math.log(sig) - eps * math.log(1 - sig)
        assert abs(float(losses[i]) - expect) < 1e-12
        assert abs(float(rc[i]) - beta * (hand[i] - float(ref_c[i]))) < 1e-12
        assert abs(float(rr[i]) - beta * (hand[3 + i] - float(ref_r[i]))) < 1e-12
    # IPO: each answer's log-ratio averaged over its tokens, squared distance to 1 / (2 beta); the
    # rewards stay those of the sums.
    ipo, irc, irr = preference_losses(pc, pr, ref_c, ref_r, beta=beta, loss="ipo", lengths=pair_halves(counts))
    for i in range(3):
        nc, nr = len(pairs.chosen[i]), len(pairs.rejected[i])
        z = (hand[i] - float(ref_c[i])) / nc - (hand[3 + i] - float(ref_r[i])) / nr
        assert abs(float(ipo[i]) - (z - 1 / (2 * beta)) ** 2) < 1e-12
    torch.testing.assert_close((irc, irr), (rc, rr))
    with pytest.raises(ValueError, match="lengths"):
        preference_losses(pc, pr, ref_c, ref_r, beta=beta, loss="ipo")


def test_prompt_tokens_never_count_and_both_sides_share_the_prompt():
    pairs = _pairs([(5, 3, 4), (2, 6, 1)])
    for pack in (False, True):
        x, y = PairCollator(pad_id=0, pack=pack)([PairSet(pairs)[i] for i in range(2)])
        torch.manual_seed(1)
        logits = torch.randn(*x["input_ids"].shape, 50)
        base = answer_logps(logits, y["labels"], y["segments"], 4)[0]
        # Any change to what the prompt positions predict (or to padding) leaves the answers' scores.
        scored = y["segments"] >= 0
        noisy = torch.where(scored.unsqueeze(-1), logits, torch.randn_like(logits) * 10)
        torch.testing.assert_close(answer_logps(noisy, y["labels"], y["segments"], 4)[0], base)
        assert int(scored.sum()) == 3 + 4 + 6 + 1
    x, _ = PairCollator(pad_id=0)([PairSet(pairs)[i] for i in range(2)])
    for i in range(2):  # chosen row i and rejected row 2 + i start with the same prompt ids
        n = len(pairs.prompts[i])
        assert torch.equal(x["input_ids"][i, :n], x["input_ids"][2 + i, :n])


def _model_logps(model, pairs, pack):
    items = [PairSet(pairs)[i] for i in range(len(pairs))]
    x, y = PairCollator(pad_id=0, pack=pack)(items)
    with torch.no_grad():
        logits = model(x)
    return answer_logps(logits, y["labels"], y["segments"], 2 * len(pairs))[0]


def test_packed_and_concatenated_batches_give_the_same_logps(tmp_path):
    from shardwise.models.hf import build_hf_model

    model = build_hf_model(pretrained=str(save_qwen2(tmp_path / "qwen"))).eval()
    pairs = _pairs([(7, 5, 9), (3, 12, 2), (10, 4, 4)], vocab=300)
    padded, packed = _model_logps(model, pairs, False), _model_logps(model, pairs, True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    # Each pair alone (no padding at all) scores the same as in the batch.
    one = [_model_logps(model, Pairs([pairs.prompts[i]], [pairs.chosen[i]], [pairs.rejected[i]]), False)
           for i in range(3)]
    alone = torch.stack([o[0] for o in one] + [o[1] for o in one])
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)


def test_lora_reference_equals_the_frozen_base(tmp_path):
    pytest.importorskip("peft")
    from shardwise.core.config import LoraConfig
    from shardwise.models.hf import build_hf_model
    from shardwise.preference.reference import adapters_off

    folder = save_qwen2(tmp_path / "qwen")
    base = build_hf_model(pretrained=str(folder)).eval()
    tuned = build_hf_model(pretrained=str(folder), lora=LoraConfig(rank=4)).eval()
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output
    pairs = _pairs([(6, 5, 7), (4, 8, 3)], vocab=300)
    frozen = _model_logps(base, pairs, False)
    with adapters_off(tuned):
        off = _model_logps(tuned, pairs, False)
    torch.testing.assert_close(off, frozen, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_model_logps(tuned, pairs, False), frozen, atol=1e-3)  # the adapters are back
    assert all(p.requires_grad for n, p in tuned.named_parameters() if "lora_" in n)


def _cfg(tmp_path, *extra, strategy="single"):
    model = tmp_path / "qwen"
    if not model.exists():
        save_qwen2(model)
    data = tmp_path / "prefs.jsonl"
    if not data.exists():
        write_jsonl(data, preference_records(40))
    return load_config("hf-dpo", [*dpo_overrides(model, data, strategy), "parallel.nproc=1", *extra])


def test_precomputed_reference_trains_exactly_as_the_live_copy_and_is_kept(tmp_path):
    from shardwise.verify import run_steps

    live = run_steps(_cfg(tmp_path), 3, tmp_path / "live")
    pre_cfg = _cfg(tmp_path, "preference.precompute_reference=true")
    pre = run_steps(pre_cfg, 3, tmp_path / "pre")
    assert live["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    np.testing.assert_allclose(pre["losses"], live["losses"], rtol=1e-6, atol=1e-7)
    assert live["losses"][-1] < live["losses"][0]  # it trained
    saved = tmp_path / "pre" / "reference_logps.npz"
    assert saved.is_file()
    # A second start in the same run directory (a resume) reads them instead of scoring its weights:
    # shifted chosen log-probs in the file move the first loss off log 2 by the expected amount.
    with np.load(saved) as z:
        kept = {k: z[k] for k in z.files}
    kept["train"] = kept["train"] + np.array([1.0, 0.0])
    np.savez(saved, **kept)
    again = run_steps(pre_cfg, 1, tmp_path / "pre")
    beta = pre_cfg.preference.beta  # z = -1 for every pair: loss = -log sigmoid(-beta)
    assert again["losses"][0] == pytest.approx(-math.log(1 / (1 + math.exp(beta))), abs=1e-6)


def _renderer(tmp_path, **dc):
    from shardwise.core.config import DataConfig
    from shardwise.data.instruct import load_hf_tokenizer

    folder = tmp_path / "qwen"
    if not folder.exists():
        save_qwen2(folder)
    cfg = DataConfig(kind="preference", tokenizer=str(folder), **dc)
    return PairRenderer(load_hf_tokenizer(str(folder)), cfg, PreferenceConfig()), cfg


@pytest.mark.parametrize("record, problem", [
    ({"prompt": "hi", "chosen": "a"}, "no rejected field"),
    ({"prompt": "hi", "chosen": "same", "rejected": "same"}, "same tokens"),
    ({"prompt": "hi", "chosen": "  ", "rejected": "b"}, "is empty"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"}, "assistant"),
    ({"chosen": "a", "rejected": "b"}, "no prompt field"),
])
def test_bad_records_are_refused_with_their_location(tmp_path, record, problem):
    good = preference_records(3)
    path = write_jsonl(tmp_path / "bad.jsonl", [*good, record])
    _, cfg = _renderer(tmp_path)
    import dataclasses

    cfg = dataclasses.replace(cfg, path=str(path), val_path=str(path))
    with pytest.raises(ConfigError, match=rf"line 4.*{problem}|{problem}.*line 4"):
        load_pairs(cfg, PreferenceConfig(), 64)


def test_prompts_longer_than_the_block_are_dropped_and_counted_by_location(tmp_path):
    renderer, _ = _renderer(tmp_path)
    long = {"prompt": " ".join(["word"] * 200), "chosen": "yes", "rejected": "no"}
    records = [(f"'f' line {i + 1}", r) for i, r in enumerate([*preference_records(3), long])]
    out = encode_pairs(records, renderer, 96, "right")
    assert len(out) == 3 and len(out.dropped) == 1 and "line 4" in out.dropped[0]
    assert "line 4" in out.describe("train")
    with pytest.raises(ConfigError, match="line 4"):
        encode_pairs(records, renderer, 96, "error")


def test_truncation_keeps_the_prompt_end_and_the_answers_start():
    p, c, r = list(range(100, 120)), list(range(30)), list(range(50, 56))
    fp, fc, fr = fit_pair(p, c, r, 24)  # the prompt keeps its last half-limit (12), the answers the rest
    assert fp == p[-12:] and fc == c[:12] and fr == r
    fp, fc, fr = fit_pair(p, [1, 2], [3], 21)  # short answers: the prompt keeps what they leave
    assert fp == p[-19:] and fc == [1, 2] and fr == [3]
    assert fit_pair(p[:5], c[:10], r, 16) == (p[:5], c[:10], r)  # fits: unchanged
    assert fit_pair(p, c, r, 20) is None  # the prompt alone fills the sequence


def test_objective_and_data_kind_go_together(tmp_path):
    with pytest.raises(ConfigError, match="objective"):
        load_config("hf-dpo", [f'model.pretrained="{tmp_path}"', "train.objective=lm"])
    with pytest.raises(ConfigError, match="objective"):
        load_config("hf-sft", [f'model.pretrained="{tmp_path}"', "train.objective=dpo"])


def test_planner_counts_the_reference_and_the_doubled_sequences():
    from shardwise.core.layout import Layout
    from shardwise.plan.memory import memory_breakdown, precision
    from shardwise.plan.preference import dpo_breakdown, reference_for
    from shardwise.plan.presets import model_preset

    spec, bf16, layout = model_preset("llama-3-8b"), precision("bf16"), Layout("fsdp", dp=8)
    lm = memory_breakdown(spec, layout, bf16, "adamw", seq=2048, micro_batch=2)
    doubled = memory_breakdown(spec, layout, bf16, "adamw", seq=2048, micro_batch=4)
    copy = dpo_breakdown(spec, layout, bf16, "adamw", seq=2048, micro_batch_pairs=2, reference="copy")
    assert copy.activations == doubled.activations > lm.activations  # 2 pairs = 4 sequences
    assert copy.params == 2 * lm.params and copy.grads == lm.grads and copy.optimizer == lm.optimizer
    free = dpo_breakdown(spec, layout, bf16, "adamw", seq=2048, micro_batch_pairs=2, reference="adapters")
    assert free.params == lm.params
    pre = dpo_breakdown(spec, layout, bf16, "adamw", seq=2048, micro_batch_pairs=2, reference="precomputed",
                        pairs=1000)
    assert pre.params == lm.params and pre.host_bytes == lm.host_bytes + 16_000
    assert [reference_for(0, False), reference_for(8, False), reference_for(8, True)] == [
        "copy", "adapters", "precomputed"]
