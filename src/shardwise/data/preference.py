"""Preference records -> token ids: a prompt and a chosen and a rejected answer per record.

``data.kind = "preference"``. A record holds ``prompt`` (a string, or a list of chat turns
``{"role", "content"}``; field ``data.prompt_field``, by default the first present of
prompt/instruction/question), ``chosen`` and ``rejected`` (``preference.chosen_field`` /
``rejected_field``: a string, one assistant turn ``{"role": "assistant", "content": ...}``, or a list
of turns that continue the conversation) and an optional ``system``. The files are read by the same
readers as the SFT kinds (JSONL, JSON, CSV, Parquet, ``datasets`` folders; ``data.records``), and
the validation split is theirs too (``data.val_path``, a datasets folder's validation split, or a
seeded ``data.val_fraction`` of the records).

Rendering (TRL's): with a chat template (the tokenizer's own or ``data.chat_template``, as for
``hf-sft``) the prompt is rendered with the generation prompt, and each answer is what the template
adds after it when the answer's turns follow; a string prompt is one user turn. Without a template
(or ``chat_template = "none"``) the prompt is the text (after the tokenizer's BOS where it adds one)
and each answer its text plus EOS. The prompt and the two answers are tokenised separately, so the
chosen and the rejected sequence start with exactly the same prompt ids and only answer tokens
are ever scored.

Bad records are refused with their location (file and line, or row): a missing or mistyped field,
an empty answer, a chosen answer identical to the rejected one. A prompt that fills the whole
sequence (``block_size + 1`` tokens) leaves no room for an answer: such records are dropped and
counted, with their locations in the data notes (``data.truncation = "error"`` refuses them).

Truncation (what TRL did before 0.29: the prompt kept its last ``max_prompt_length`` tokens, each
answer its first ``max_completion_length``; TRL since cuts prompt + answer as one sequence): a
pair longer than the sequence keeps the END of its prompt (down to half the sequence, or less where
the longer answer needs more room) and the START of each answer; ``data.truncation = "drop"`` drops
such pairs and ``"error"`` refuses them. Every cut is counted in the notes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.core.config import DataConfig, PreferenceConfig
from shardwise.data.instruct import PROMPT_FIELDS, ROLES, load_hf_tokenizer, records_of_part
from shardwise.data.records import SAMPLE_CHAT, Record
from shardwise.errors import ConfigError

_SHOWN = 5  # record locations listed in a note


@dataclasses.dataclass
class Pairs:
    """The kept pairs' token ids (prompt, chosen answer, rejected answer) and what was cut or dropped."""

    prompts: list[np.ndarray]
    chosen: list[np.ndarray]
    rejected: list[np.ndarray]
    records: int = 0
    truncated: int = 0
    dropped: list[str] = dataclasses.field(default_factory=list)  # where each dropped record is
    tokens_lost: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self, what: str) -> str:
        tokens = sum(len(p) * 2 + len(c) + len(r) for p, c, r in zip(self.prompts, self.chosen, self.rejected))
        shown = "; ".join(self.dropped[:_SHOWN]) + (" ..." if len(self.dropped) > _SHOWN else "")
        return (f"data: {what}: {self.records:,} preference records, {len(self):,} kept ({self.truncated:,} "
                f"truncated, {len(self.dropped):,} dropped{': ' + shown if shown else ''}; {self.tokens_lost:,} "
                f"tokens lost); {tokens:,} tokens in both sequences")


class PairRenderer:
    """One preference record -> (prompt ids, chosen ids, rejected ids)."""

    def __init__(self, tok: Any, dc: DataConfig, pc: PreferenceConfig) -> None:
        self.tok, self.dc, self.pc = tok, dc, pc
        self.templated = bool(getattr(tok, "chat_template", None)) and dc.chat_template != "none"

    def _turns(self, value: Any, where: str, name: str, *, answer: bool) -> list[dict[str, str]]:
        items = [value] if isinstance(value, dict) else value
        if not isinstance(items, list) or not items:
            raise ConfigError(f"{where}: field {name!r} must be a string, a {{role, content}} turn or a non-empty "
                              f"list of them, got {type(value).__name__ if value != [] else 'an empty list'}.")
        turns = []
        for i, m in enumerate(items):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ConfigError(f"{where}: turn {i} of {name!r} must be an object with a 'role' (one of "
                                  f"{', '.join(ROLES)}) and a string 'content', got {str(m)[:80]}.")
            turns.append({"role": m["role"], "content": m["content"]})
        if answer and turns[-1]["role"] != "assistant":
            raise ConfigError(f"{where}: the last turn of {name!r} has role {turns[-1]['role']!r}; an answer ends "
                              "with the assistant's turn.")
        return turns

    def _field(self, record: dict[str, Any], where: str, names: tuple[str, ...], what: str) -> tuple[str, Any]:
        for name in names:
            if record.get(name) is not None:
                return name, record[name]
        fields = ", ".join(sorted(map(str, record))[:12]) or "none"
        raise ConfigError(f"{where} has no {what} field (looked for {', '.join(map(repr, names))}; its fields: "
                          f"{fields}). A preference record holds a prompt and a chosen and a rejected answer; "
                          f"name the fields with data.prompt_field, preference.chosen_field and "
                          "preference.rejected_field.")

    def encode(self, record: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int]]:
        dc, pc = self.dc, self.pc
        p_name, prompt = self._field(record, where, (dc.prompt_field,) if dc.prompt_field else PROMPT_FIELDS,
                                     "prompt")
        answers = [self._field(record, where, (name,), what)
                   for name, what in ((pc.chosen_field, "chosen"), (pc.rejected_field, "rejected"))]
        system = record.get(dc.system_field)
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{where}: field {dc.system_field!r} is a {type(system).__name__}, not a string.")
        for name, value in answers:
            text = value if isinstance(value, str) else " ".join(
                t.get("content", "") for t in ([value] if isinstance(value, dict) else value or [])
                if isinstance(t, dict) and isinstance(t.get("content"), str))
            if not text.strip():
                raise ConfigError(f"{where}: the answer in {name!r} is empty; every record needs a non-empty "
                                  "chosen and rejected answer.")
        if self.templated:
            p_ids, a_ids = self._templated(prompt, p_name, answers, system or "", where)
        else:
            p_ids, a_ids = self._plain(prompt, p_name, answers, system or "", where)
        if a_ids[0] == a_ids[1]:
            raise ConfigError(f"{where}: the chosen and the rejected answer are the same tokens; a preference pair "
                              "needs two different answers (remove the record or fix its fields).")
        return p_ids, a_ids[0], a_ids[1]

    def _plain(self, prompt: Any, p_name: str, answers: list[tuple[str, Any]], system: str,
               where: str) -> tuple[list[int], list[list[int]]]:
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: field {p_name!r} is a list of chat turns, which needs a chat template; the "
                              "tokenizer has none (or data.chat_template = 'none'). Name a template file with "
                              "data.chat_template, or write the prompt as text.")
        text = "\n\n".join(t for t in (system, prompt) if t)
        p_ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []
        bos = self.tok.bos_token_id
        if bos is not None and self.tok("", add_special_tokens=True)["input_ids"][:1] == [bos]:
            p_ids = [bos, *p_ids]  # the BOS the model was trained after (Llama, Mistral, Gemma)
        a_ids = []
        for name, value in answers:
            if not isinstance(value, str):
                raise ConfigError(f"{where}: field {name!r} holds chat turns, which need a chat template; write the "
                                  "answer as text, or name a template file with data.chat_template.")
            a_ids.append(list(self.tok(value, add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id])
        return p_ids, a_ids

    def _render(self, turns: list[dict[str, str]], generation_prompt: bool, where: str) -> str:
        try:
            return self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template raising (Jinja errors, raise_exception) is bad input
            raise ConfigError(f"{where}: the chat template fails on this record: {type(e).__name__}: {e}") from None

    def _templated(self, prompt: Any, p_name: str, answers: list[tuple[str, Any]], system: str,
                   where: str) -> tuple[list[int], list[list[int]]]:
        turns = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                 else self._turns(prompt, where, p_name, answer=False))
        if system and turns[0]["role"] != "system":
            turns = [{"role": "system", "content": system}, *turns]
        head = self._render(turns, True, where)
        a_ids = []
        for name, value in answers:
            answer = ([{"role": "assistant", "content": value}] if isinstance(value, str)
                      else self._turns(value, where, name, answer=True))
            full = self._render(turns + answer, False, where)
            if not full.startswith(head):
                raise ConfigError(f"{where}: the chat template renders the prompt differently once the {name!r} "
                                  "answer follows it, so the answer's tokens cannot be told from the prompt's. Use "
                                  "a template that renders earlier turns the same whatever follows "
                                  "(data.chat_template).")
            a_ids.append(list(self.tok(full[len(head):], add_special_tokens=False)["input_ids"]))
        return list(self.tok(head, add_special_tokens=False)["input_ids"]), a_ids


def fit_pair(p: list[int], c: list[int], r: list[int], limit: int) -> tuple[list[int], list[int], list[int]] | None:
    """The pair cut to ``limit`` tokens per sequence (prompt + answer), or None when the prompt alone
    fills it. The prompt keeps its end, down to half the limit (less where the longer answer leaves
    more room); each answer keeps its start."""
    if len(p) >= limit:
        return None
    longest = max(len(c), len(r))
    if len(p) + longest > limit:
        keep = min(len(p), max(limit // 2, limit - longest))
        p = p[len(p) - keep:]
        room = limit - len(p)
        c, r = c[:room], r[:room]
    return p, c, r


def encode_pairs(records: list[Record], renderer: PairRenderer, block_size: int, truncation: str) -> Pairs:
    """Every record encoded, with ``data.truncation`` applied to pairs longer than ``block_size + 1``."""
    limit = block_size + 1  # a sequence of L tokens fills L - 1 positions
    out = Pairs([], [], [], records=len(records))
    for where, record in records:
        p, c, r = renderer.encode(record, where)
        longest = len(p) + max(len(c), len(r))
        if longest > limit and truncation == "error":
            raise ConfigError(f"{where} is {longest} tokens long (prompt {len(p)} + longer answer), more than the "
                              f"sequence of {limit} (block_size {block_size} + 1), and data.truncation = 'error'. "
                              "Raise the block size, or set data.truncation = 'right' (keep the prompt's end and "
                              "the answers' start) or 'drop'.")
        fitted = fit_pair(p, c, r, limit) if truncation == "right" or longest <= limit else None
        if fitted is None:
            out.dropped.append(f"{where} ({'prompt of ' + str(len(p)) + ' tokens' if len(p) >= limit else 'too long'})")
            out.tokens_lost += 2 * len(p) + len(c) + len(r)
            continue
        fp, fc, fr = fitted
        if (fp, fc, fr) != (p, c, r):
            out.truncated += 1
            out.tokens_lost += 2 * (len(p) - len(fp)) + len(c) - len(fc) + len(r) - len(fr)
        if fc == fr:  # the cut left the two answers the same: nothing to prefer
            out.dropped.append(f"{where} (answers equal after truncation)")
            continue
        out.prompts.append(np.asarray(fp, np.int64))
        out.chosen.append(np.asarray(fc, np.int64))
        out.rejected.append(np.asarray(fr, np.int64))
    return out


def load_pairs(dc: DataConfig, pc: PreferenceConfig, block_size: int) -> tuple[Pairs, Pairs, Any]:
    """(train pairs, validation pairs, tokenizer) of the preference records ``dc`` names."""
    if dc.train_on_prompt:
        raise ConfigError("data.train_on_prompt = true does not apply to preference data: DPO scores the answers "
                          "only (a prompt token counted would add the same term to both sides). Unset it.")
    if not dc.path:
        raise ConfigError("data.kind = 'preference' needs data.path: a JSONL/JSON/CSV/Parquet file of "
                          "prompt/chosen/rejected records, a folder of them, or a datasets folder (save_to_disk).")
    tok = load_hf_tokenizer(dc.tokenizer, dc.chat_template)
    renderer = PairRenderer(tok, dc, pc)
    parts = []
    for part in ("train", "val"):
        pairs = encode_pairs(records_of_part(dc, part), renderer, block_size, dc.truncation)
        if not len(pairs):
            raise ConfigError(f"no {part} preference record is left ({pairs.records} read, {len(pairs.dropped)} "
                              "dropped: prompts longer than the sequence or pairs that do not fit); raise the "
                              "block size (model.overrides.block_size) or check data.truncation.")
        parts.append(pairs)
    return parts[0], parts[1], tok


def sample_preferences(out_dir: str | Any, records: int = 300, held_out_prompts: int = 10, *,
                       per_prompt: int = 5, seed: int = 0) -> tuple[Any, Any]:
    """Write ``train.jsonl`` and ``val.jsonl`` preference records made from the shipped sample chats
    (``data.records.SAMPLE_CHAT``): each prompt's own answer is chosen, the answer of another
    record rejected. The last ``held_out_prompts`` prompts (in a seeded order) are only in
    ``val.jsonl``: held-out pairs, not held-out rejections of trained prompts. Returns both paths."""
    chats = [json.loads(line)["messages"] for line in SAMPLE_CHAT.read_text(encoding="utf-8").splitlines() if line]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(chats))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for k, i in enumerate(order):
        prompt, answer = chats[i][:-1], chats[i][-1]["content"]
        others = [j for j in rng.permutation(len(chats)) if chats[j][-1]["content"] != answer][:per_prompt]
        for j in others:
            pairs.append((k >= len(chats) - held_out_prompts,
                          {"prompt": prompt, "chosen": answer, "rejected": chats[j][-1]["content"]}))
    pairs = pairs[:records] if len(pairs) >= records else pairs
    paths = out / "train.jsonl", out / "val.jsonl"
    for held, path in zip((False, True), paths):
        path.write_text("".join(json.dumps(p) + "\n" for h, p in pairs if h == held), encoding="utf-8")
    return paths
