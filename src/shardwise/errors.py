"""User-facing errors: each one carries a message that says what was wrong and what is allowed.

The CLI prints these as one paragraph and exits with code 2; anything else that escapes is a bug
in shardwise and is shown with its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ShardwiseError(Exception):
    """A mistake the user can fix (bad config, flag, path, checkpoint, world size)."""

    exit_code = 2


class ConfigError(ShardwiseError):
    """A configuration value is missing, unknown or out of range."""


class CheckpointError(ShardwiseError):
    """A checkpoint is missing, corrupted or incompatible with the run."""


# `shardwise train` exit codes: 2 user error (any ShardwiseError), 3 hang (runtime.watchdog),
# 4 stopped on a non-finite loss, 130 interrupted (a checkpoint was saved).
NONFINITE_EXIT_CODE = 4


class NonFiniteError(ShardwiseError):
    """Training produced a NaN/inf loss, gradient norm or weights and was stopped (exit code 4)."""

    exit_code = NONFINITE_EXIT_CODE


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ' Did you mean X?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def plural(noun: str) -> str:
    """English plural of the last word of ``noun`` ('strategy' -> 'strategies', 'GPU kind' -> 'GPU kinds')."""
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u", ""):
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def count_of(n: int, noun: str) -> str:
    """'1 rank', '2 ranks': ``n`` and ``noun`` in the number it needs."""
    return f"{n} {noun if n == 1 else plural(noun)}"


def unknown_choice(kind: str, name: str, choices: Iterable[str],
                   aliases: Iterable[tuple[str, str]] = ()) -> ConfigError:
    """Build the standard 'unknown X' error that lists every valid choice.

    ``kind`` is a noun ('strategy') or a config key ('data.token_dtype'); a key gets "valid
    values", since the plural of a key is not a word. ``aliases`` (other name, canonical choice)
    are listed too, and a name close to an alias suggests the choice it stands for.
    """
    valid = sorted(choices)
    what = f"values of {kind}" if "." in kind else plural(kind)
    alias_map = dict(aliases)
    close = difflib.get_close_matches(name, [*valid, *alias_map], n=1, cutoff=0.5)
    hint = f" Did you mean {alias_map.get(close[0], close[0])!r}?" if close else ""
    also = f" (also accepted: {', '.join(alias_map)})" if alias_map else ""
    return ConfigError(f"unknown {kind} {name!r}.{hint} Valid {what}: {', '.join(valid)}{also}.")
