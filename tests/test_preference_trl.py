"""shardwise's DPO against TRL's ``DPOTrainer`` itself (trl >= 0.29; the dev extra installs it).

The same records and weights go through both: a real ``DPOTrainer`` (CPU, the reference a frozen
copy of the starting weights, no precomputed log-probs) evaluates them as one batch, in eval mode,
without an optimizer step; shardwise renders them with its own path (``PairRenderer`` /
``encode_pairs``, ``PairCollator``, ``build_hf_model``, ``answer_logps``) and reports the metrics
its DPO step logs. The token ids of every prompt and answer are TRL's (so templating, EOS and the
prompt mask agree) and the loss, rewards, margin, accuracy and log-probs are TRL's, for DPO
(``sigmoid``, no label smoothing: TRL's sigmoid has none) and IPO, with chat records (the chat
template) and plain-text ones. The policy is the reference with every weight nudged, so the loss
is not log 2.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("trl", minversion="0.29")  # the DPOTrainer rewrite (pyproject.toml, the dev extra)

from shardwise.core.config import DataConfig, PreferenceConfig  # noqa: E402
from shardwise.data.instruct import load_hf_tokenizer  # noqa: E402
from shardwise.data.preference import PairRenderer, encode_pairs  # noqa: E402
from shardwise.models.hf import build_hf_model  # noqa: E402
from shardwise.preference.batches import PairCollator, PairSet  # noqa: E402
from shardwise.preference.objective import answer_logps, pair_halves  # noqa: E402
from shardwise.preference.step import PreferenceStep  # noqa: E402
from tests.helpers.sft import save_qwen2  # noqa: E402

BETA = 0.3
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon"]
# TRL's metric -> shardwise's (``dpo/...`` in metrics.jsonl); TRL logs means over the batch's pairs.
METRICS = {"eval_loss": "dpo/loss", "eval_rewards/chosen": "dpo/reward_chosen",
           "eval_rewards/rejected": "dpo/reward_rejected", "eval_rewards/margins": "dpo/margin",
           "eval_rewards/accuracies": "dpo/accuracy", "eval_logps/chosen": "dpo/logp_chosen",
           "eval_logps/rejected": "dpo/logp_rejected"}


def _records(chat: bool) -> list[dict]:
    """Four pairs with answers of different lengths, the longer one chosen in half of them (the nudged
    policy loses more log-prob on longer answers: some rewards favour the rejected answer). Plain-text
    answers start with a space, as in TRL's examples: TRL tokenises prompt + answer as one text,
    shardwise each part alone, which agree where the answer starts a new word."""
    out = []
    for i in range(4):
        q, a, b = WORDS[i], WORDS[i + 1], WORDS[i + 2]
        short, long = f"It is {a}.", f"Maybe {b} or {q}, not sure at all. " * (1 + i // 2)
        prompt, chosen, rejected = f"Which word goes with {q}?", *((short, long) if i % 2 else (long, short))
        if chat:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(reference, policy): a tiny Qwen2 folder (ChatML template) and a copy with every weight nudged."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("trl")
    ref = save_qwen2(root / "ref")
    policy = shutil.copytree(ref, root / "policy")
    model = AutoModelForCausalLM.from_pretrained(str(policy))
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise), alpha=0.05)
    model.save_pretrained(str(policy))
    return ref, policy


def _trl(folders, records: list[dict], loss: str, out) -> tuple[dict, list[dict]]:
    """TRL's evaluation of all the pairs as one batch, and its tokenised pairs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    ref, policy = folders
    # bf16=False: DPOConfig's default bf16=True runs the reference under accelerate's bf16 autocast
    # wrapper (the CPU evaluation's policy forward stays fp32), which moves its log-probs by ~1e-3.
    args = DPOConfig(output_dir=str(out), report_to="none", use_cpu=True, disable_tqdm=True, loss_type=[loss],
                     beta=BETA, max_length=None, precompute_ref_log_probs=False, bf16=False,
                     per_device_eval_batch_size=len(records))
    data = Dataset.from_list(records)
    trainer = DPOTrainer(AutoModelForCausalLM.from_pretrained(str(policy)),
                         ref_model=AutoModelForCausalLM.from_pretrained(str(ref)), args=args, train_dataset=data,
                         eval_dataset=data, processing_class=AutoTokenizer.from_pretrained(str(ref)))
    trainer.evaluate()
    # What it logged (trl 1.0's evaluate() returns only the loss; 1.16's returns these too).
    return trainer.state.log_history[-1], list(trainer.eval_dataset)


def _shardwise(folders, records: list[dict], loss: str, chat: bool) -> tuple[dict, object]:
    """What shardwise's DPO step logs for the same pairs (one batch, one process), and its pairs."""
    ref, policy = folders
    dc = DataConfig(kind="preference", tokenizer=str(ref), chat_template="" if chat else "none")
    pc = PreferenceConfig(beta=BETA, loss=loss)
    tok = load_hf_tokenizer(str(ref), dc.chat_template)
    pairs = encode_pairs([(f"record {i}", r) for i, r in enumerate(records)], PairRenderer(tok, dc, pc), 256, "error")
    x, y = PairCollator(tok.pad_token_id)([PairSet(pairs)[i] for i in range(len(pairs))])
    scores = []
    for folder in (policy, ref):
        model = build_hf_model(pretrained=str(folder)).eval()
        with torch.no_grad():
            scores.append(pair_halves(answer_logps(model(x), y["labels"], y["segments"], 2 * len(pairs))[0]))
    step = PreferenceStep.__new__(PreferenceStep)  # its loss and metric arithmetic only: no trainer, one process
    step.pc, step.session = pc, SimpleNamespace(is_distributed=False)
    _, sums = step._terms(*scores[0], scores[1], step._lengths(y, 2 * len(pairs)))
    return step._means(sums, "dpo/"), pairs


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_matches_trl_dpo_trainer(folders, tmp_path, loss, chat):
    records = _records(chat)
    theirs, tokenised = _trl(folders, records, loss, tmp_path / "trl")
    ours, pairs = _shardwise(folders, records, loss, chat)
    assert len(pairs) == len(tokenised) == 4
    for i, row in enumerate(tokenised):
        assert pairs.prompts[i].tolist() == row["prompt_ids"]
        assert pairs.chosen[i].tolist() == row["chosen_ids"]
        assert pairs.rejected[i].tolist() == row["rejected_ids"]
    assert abs(ours["dpo/margin"]) > 0.1 and 0 < ours["dpo/accuracy"] < 1  # policy != reference, both signs
    for name, mine in METRICS.items():
        # float32: the log-prob sums (140-230 nats) agree to ~1e-7 relative, so the rewards (beta x
        # their differences) to ~1e-5 absolute.
        assert ours[mine] == pytest.approx(theirs[name], rel=1e-5, abs=5e-5), (name, ours[mine], theirs[name])
