"""Where a chat template puts each assistant turn: the characters of the rendered text to train on.

Templates that mark their assistant output with ``{% generation %}`` ... ``{% endgeneration %}``
say it themselves (``has_generation_markers``; ``data.instruct`` then takes transformers'
``assistant_masks``). Most models' own templates do not (Llama 3, Mistral, Gemma, Phi-3, Qwen2,
Qwen3), so the spans are found from renderings of the record, two ways, the first that holds:

1. **Prefixes.** For assistant turn ``i``: ``before`` = the turns before it with the generation
   prompt, ``through`` = the turns through it. When both are prefixes of the whole rendering, the
   span is ``[len(before), len(through))``: what the template adds after the generation prompt (a
   ``<think>`` block, a leading space), the content, and its end-of-turn marker (``<|im_end|>\\n``,
   ``<|eot_id|>``, ``</s>``, ``<end_of_turn>\\n``).
2. **A sentinel.** Some templates render a turn differently once later turns follow it: Phi-3
   ends a conversation with an EOS that a later turn replaces, Qwen3 drops the ``<think>`` block of
   turns before the last user message, Mistral v0.3 moves the system prompt into the last user
   message. The whole record is rendered again with turn ``i``'s content replaced by a sentinel
   string; the text before and after the sentinel is shared with the real rendering, which pins the
   content's characters (as the template trimmed it) in the real text. The span then runs from the
   end of ``before`` when that is a prefix (else from the content) to the content's end plus the
   end-of-turn marker: the longest common start of what follows the content in the real rendering
   and in ``through`` rendered with the sentinel.

A record where neither holds is refused with a message naming the turn and the problem.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from shardwise.errors import ConfigError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Letters only: no whitespace for a template to trim, nothing a tokenizer treats as special.
SENTINEL = "Zqxsentinelturnqxz"

Render = Callable[[list[dict[str, Any]], bool], str]
TokenEnds = Callable[[str], list[int]]


def has_generation_markers(template: str | None) -> bool:
    """Whether the template marks its assistant output with ``{% generation %}`` blocks."""
    return isinstance(template, str) and bool(_GENERATION.search(template))


def _common_start(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def assistant_spans(render: Render, turns: list[dict[str, Any]], where: str,
                    token_ends: TokenEnds | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered record and the ``[start, end)`` character spans of its assistant turns.

    ``render(turns, generation_prompt)`` renders turns with the record's template; ``token_ends(text)``
    gives the character offsets where the tokenizer's tokens of ``text`` end (so an end-of-turn
    marker is cut between tokens: ``<|end|>\n<|endoftext|>`` and ``<|end|>\n<|user|>`` share
    ``<|end|>\n``, not ``<|end|>\n<|``). ConfigError names the record and the turn whose span no
    rendering pins down."""
    full = render(turns, False)
    spans: list[tuple[int, int]] = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _before(render, turns, i)
        through = render(turns[:i + 1], False)
        stable_start = before is not None and full.startswith(before)
        if stable_start and full.startswith(through) and len(through) > len(before):  # type: ignore[arg-type]
            span = (len(before), len(through))
        else:
            span = _sentinel_span(render, turns, i, full, before if stable_start else None, where, token_ends)
        if spans and span[0] < spans[-1][1]:
            raise ConfigError(f"{where}: the chat template's spans of assistant turns overlap at turn {i}; its "
                              "assistant tokens cannot be told apart. Use another template (data.chat_template) "
                              "or data.train_on_prompt = true.")
        spans.append(span)
    return full, spans


def _before(render: Render, turns: list[dict[str, Any]], i: int) -> str | None:
    """The turns before turn ``i`` with the generation prompt; None where the template cannot render
    them (no turns at all: many templates read ``messages[0]``)."""
    if i:
        return render(turns[:i], True)
    try:
        return render([], True)
    except Exception:  # noqa: BLE001 - the sentinel method does without it
        return None


def _sentinel_span(render: Render, turns: list[dict[str, Any]], i: int, full: str, before: str | None,
                   where: str, token_ends: TokenEnds | None) -> tuple[int, int]:
    def refuse(problem: str) -> ConfigError:
        return ConfigError(
            f"{where}: the chat template renders no assistant span for turn {i}: {problem}. Its tokens cannot be "
            "told from the prompt's. Use a template that renders each turn the same whatever follows it, or marks "
            "assistant output with {% generation %} (data.chat_template), or data.train_on_prompt = true.")

    if SENTINEL in full:
        raise refuse("the record contains the sentinel text used to locate turns")
    marked = [dict(t, content=SENTINEL) if k == i else t for k, t in enumerate(turns)]
    with_sentinel = render(marked, False)
    if with_sentinel.count(SENTINEL) != 1:
        raise refuse("the template does not render the turn's content once, as given (it drops, repeats or "
                     "rewrites it)")
    at = with_sentinel.index(SENTINEL)
    head, tail = with_sentinel[:at], with_sentinel[at + len(SENTINEL):]
    if not (full.startswith(head) and full.endswith(tail) and len(head) + len(tail) <= len(full)):
        raise refuse("rendering the turn's content changes the text around it")
    lo, hi = len(head), len(full) - len(tail)
    # The end-of-turn marker: what the template writes after the content when the turn is the last
    # one, as far as the real rendering (with the turns that follow) writes the same.
    through = render(marked[:i + 1], False)
    after = through[through.index(SENTINEL) + len(SENTINEL):] if SENTINEL in through else ""
    shared = _common_start(full[hi:], after)
    if token_ends is not None and shared < len(after):
        shared = max([e for e in token_ends(after) if e <= shared], default=0)
    end = hi + shared
    if after and end == hi:
        raise refuse("the template writes no end-of-turn marker after the turn's content")
    start = len(before) if before is not None and len(before) <= lo else lo
    if end <= start:
        raise refuse("the span is empty")
    return start, end


def trained_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Which tokens (character ``offsets`` from a fast tokenizer) fall in the spans: a token that
    overlaps one (a sentencepiece token may carry the space before the content), or, empty, starts in it."""
    out = []
    for s, e in offsets:
        if e > s:
            out.append(any(s < hi and e > lo for lo, hi in spans))
        else:
            out.append(any(lo <= s < hi for lo, hi in spans))
    return out
