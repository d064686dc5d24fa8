"""A tiny Qwen2 folder with a ChatML chat template (save_pretrained, made in the test) and
chat / prompt-response records, for the instruction-tuning tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.text import corpus_text

VOCAB = 320
# Qwen2's own template (ChatML), shortened: a default system turn when there is none.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tokenizer(folder: Path, *, template: str | None = CHATML) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus_text(20000)], trainer)
    kwargs = {"chat_template": template} if template else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def save_qwen2(folder: Path, *, seed: int = 0, template: str | None = CHATML) -> Path:
    """A randomly initialised 2-layer Qwen2 and its ChatML tokenizer, saved like a downloaded model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(str(folder))
    save_tokenizer(folder, template=template)
    return folder


def save_gpt2(folder: Path, *, seed: int = 0, template: str | None = CHATML) -> Path:
    """A randomly initialised 2-layer GPT-2 (learned positions, tied head) and the ChatML tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    save_tokenizer(folder, template=template)
    return folder


def save_qwen2_moe(folder: Path, *, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Qwen2-MoE (4 experts, top-2, a shared expert) and the ChatML
    tokenizer, saved by transformers in the per-expert layout of the released checkpoints."""
    return _save_moe(folder, "qwen2_moe", seed, shared_expert_intermediate_size=32, norm_topk_prob=False)


def save_qwen3_moe(folder: Path, *, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Qwen3-MoE (4 experts, top-2, no shared expert; a family context
    parallel runs) and the ChatML tokenizer."""
    return _save_moe(folder, "qwen3_moe", seed, head_dim=8, norm_topk_prob=True)


def _save_moe(folder: Path, model_type: str, seed: int, **extra) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                               max_position_embeddings=256, tie_word_embeddings=False, **extra)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` chat records of varying length, some multi-turn, some with a system prompt."""
    text = corpus_text(40000)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        def piece(lo: int, hi: int) -> str:
            start = int(torch.randint(0, len(text) - hi, (1,), generator=g))
            return text[start:start + int(torch.randint(lo, hi, (1,), generator=g))].strip() or "ok"
        turns = [{"role": "user", "content": piece(5, 25)}, {"role": "assistant", "content": piece(5, 30)}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": piece(3, 12)}, {"role": "assistant", "content": piece(3, 15)}]
        rec: dict = {"messages": turns}
        if i % 4 == 1:
            rec["system"] = "Answer in verse."
        out.append(rec)
    return out


def instruct_records(n: int, seed: int = 0) -> list[dict]:
    return [{"prompt": r["messages"][0]["content"], "response": r["messages"][1]["content"]}
            for r in chat_records(n, seed)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def verify_cases(rank: int, world_size: int, cases: list[dict]) -> list:
    """Rank function: ``verify.run_steps`` of several configs back to back in the same ranks (one spawn)."""
    from shardwise.verify import run_steps

    return [run_steps(case["cfg"], case["steps"], case["out"]) for case in cases]


def per_record_losses(model, records: list[dict], pad_id: int, block: int) -> dict[str, list]:
    """Each record's per-token losses (trained targets only, record order) computed three ways: packed
    rows of ``block`` tokens, one padded batch, and each record alone."""
    import torch.nn.functional as F

    from shardwise.data.collate import RecordCollator
    from shardwise.data.packing import RowSequences

    def losses(x, y, key):
        dev = next(model.parameters()).device
        with torch.no_grad():
            logits = model({k: v.to(dev) for k, v in x.items()})
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        per = F.cross_entropy(logits.flatten(0, 1).float().cpu(), y.flatten(), ignore_index=-100,
                              reduction="none").view(y.shape)
        out = []
        for row in range(y.shape[0]):
            docs = x[key][row]
            for d in (sorted(set(docs.tolist()) - {-1}) if key == "doc_ids" else [1]):
                out.append(per[row][(docs == d) & (y[row] != -100)])
        return out

    packed = losses(*RecordCollator(pad_id, pack=True, block_size=block)(records), "doc_ids")
    rows = RowSequences([r["input_ids"] for r in records], [r["labels"] for r in records], block, True, pad_id).rows
    order = [i for row in rows for i in row]
    by_record = [None] * len(records)
    for k, i in enumerate(order):
        by_record[i] = packed[k]
    return {"packed": by_record,
            "padded": losses(*RecordCollator(pad_id)(records), "attention_mask"),
            "alone": [losses(*RecordCollator(pad_id)([r]), "attention_mask")[0] for r in records]}


def encoded_chat(model_folder: Path, records: list[dict], block: int) -> tuple[list[dict], int]:
    """``records`` rendered and tokenised by the folder's tokenizer: [{input_ids, labels}], pad id."""
    from shardwise.core.config import DataConfig
    from shardwise.data.instruct import RecordRenderer, encode_records, load_hf_tokenizer

    r = RecordRenderer(load_hf_tokenizer(str(model_folder)), DataConfig(kind="chat", tokenizer=str(model_folder)))
    enc = encode_records([(f"rec {i}", rec) for i, rec in enumerate(records)], r, block, "error")
    return [{"input_ids": i, "labels": lab} for i, lab in zip(enc.ids, enc.labels)], r.tok.pad_token_id


def sft_rank(rank: int, world_size: int, cases: list[dict], model_folder: str, records: list[dict],
             block: int) -> dict:
    """Rank function of the one spawn: ``verify_cases``, then per-record losses under ddp and fsdp
    (each rank its own share of the records: packed, padded and alone), gathered on rank 0."""
    import torch.distributed as dist

    from shardwise import Session
    from shardwise.models.hf import build_hf_model

    out = {"verify": verify_cases(rank, world_size, cases), "per_record": {}}
    enc, pad = encoded_chat(Path(model_folder), records, block)
    mine = list(range(rank, len(enc), world_size))
    for strategy in ("ddp", "fsdp"):
        with Session(strategy) as session:
            model, _ = session.prepare(build_hf_model(pretrained=model_folder).eval())
            got = per_record_losses(model, [enc[i] for i in mine], pad, block)
            parts: list = [None] * world_size
            dist.all_gather_object(parts, {"index": mine, **got})
            out["per_record"][strategy] = parts
    return out
