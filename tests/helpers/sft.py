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
