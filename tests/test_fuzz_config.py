"""Schema-driven fuzzing of configs and flags (Hypothesis): no traceback, ever.

The cases come from the typed config itself: every field of ``RunConfig`` with its type, default
and ``Rule`` (bounds, choices, text kind), so a field added later is fuzzed without touching this
file. Each case starts from a small valid job and applies one to three mutations:

* a field set to a valid value (boundaries included) or an invalid one: out of bounds, NaN/inf,
  huge integers, the wrong type, control characters, lone surrogates, over-long or odd unicode
  text, unknown choices;
* an unknown key, a section given a value, a value given a table, keys nested too deep;
* a malformed ``--set``.

It is delivered as a raw dict (``from_dict``), as ``--set`` flags or as a TOML file, and checked:

* config resolution either returns a config (exactly when every mutation was valid) or raises a
  ShardwiseError (exactly when one was not); any other exception is a bug;
* preflight (``check_run``: strategy, data, model on the meta device) raises nothing but
  ShardwiseError;
* every fourth case also goes through ``shardwise.cli.main(["train", "--dry-run", ...])``
  in-process: invalid input exits 2 with one paragraph, valid input of the "free" fields exits 0;
* ``test_fuzz_real_train`` runs a few cases through a real ``shardwise train`` subprocess.

Reproducible in CI (the "ci" Hypothesis profile: derandomized, no example database). Explore
locally with ``HYPOTHESIS_PROFILE=explore SHARDWISE_FUZZ_EXAMPLES=5000 pytest
tests/test_fuzz_config.py --hypothesis-seed=N``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardwise.cli import main
from shardwise.core.config import Rule, RunConfig, from_dict, load_config, rule_of, to_toml, toml_string
from shardwise.errors import ShardwiseError
from tests.helpers.ckpt import small_text

EXAMPLES = int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", "600"))
TEXT_LIMITS = {"path": 4096, "name": 200}


# ------------------------------------------------------------------ the schema, from the dataclasses
@dataclass(frozen=True)
class FieldSpec:
    key: str  # dotted, e.g. "train.lr"
    tp: Any
    default: Any
    rule: Rule | None


def schema(cls: type = RunConfig, prefix: str = "") -> list[FieldSpec]:
    """Every leaf field of the config, with its type, default and Rule."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += schema(tp, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(FieldSpec(f"{prefix}{f.name}", tp, default, rule_of(f)))
    return out


FIELDS = schema()
BY_KEY = {f.key: f for f in FIELDS}
SECTIONS = sorted({f.key.split(".")[0] for f in FIELDS if "." in f.key})
# Fields whose valid values cannot make this small job fail (no file system, world size or model
# coupling, no fault injection): a case changing only these must resolve, pass `train --dry-run`
# with exit 0, and (test_fuzz_real_train) train.
# (train.objective couples to data.kind: "dpo" needs preference records.)
FREE = {f.key for f in FIELDS if f.key.split(".")[0] in ("train", "checkpoint", "watchdog")
        and f.key not in ("checkpoint.resume", "train.objective")} | {
            "name", "data.num_workers", "parallel.activation_checkpointing", "parallel.ac_every", "model.overrides"}
# Valid ranges narrowed for FREE fields, where the whole schema range would make the small job
# fail or run long for reasons that are not config errors (a batch larger than the tiny dataset,
# a billion steps, a watchdog shorter than a step, 256 loader processes).
FREE_RANGES = {"train.micro_batch_size": (1, 8), "train.grad_accum_steps": (1, 4), "train.steps": (1, 3),
               "train.eval_batches": (1, 2), "train.sample_tokens": (0, 20), "data.num_workers": (0, 1),
               "watchdog.timeout_s": (120.0, 604800.0), "watchdog.collective_timeout_s": (120.0, 604800.0)}


# ------------------------------------------------------------------ values
def _bounds(rule: Rule | None, tp: Any) -> tuple[Any, Any, bool, bool]:
    """(low, high, exclude_low, exclude_high) of a numeric rule (None: unbounded)."""
    if rule is None:
        return None, None, False, False
    low, ex_low = (rule.ge, False) if rule.ge is not None else (rule.gt, rule.gt is not None)
    high, ex_high = (rule.le, False) if rule.le is not None else (rule.lt, rule.lt is not None)
    if tp is int:
        if ex_low:
            low, ex_low = int(low) + 1, False
        if ex_high:
            high, ex_high = int(high) - 1, False
    return low, high, ex_low, ex_high


_SAFE_CHARS = st.characters(exclude_categories=("Cc", "Cs"))
_ODD_TEXT = st.sampled_from(["東京", "🚀 run", "\u200bzero-width", "\u202eevil", "é", " padded ", "ÿ" * 3])


def _valid_text(rule: Rule | None) -> st.SearchStrategy:
    kind = rule.text if rule else "word"
    if kind == "name":
        return st.text(_SAFE_CHARS.filter(lambda c: c not in "/\\"), min_size=1, max_size=40).filter(
            lambda s: s.strip() and s not in (".", "..")) | _ODD_TEXT
    if kind == "factory":
        return st.just("") | st.from_regex(r"[a-z_][a-z0-9_]{0,8}(\.[a-z_][a-z0-9_]{0,8}){0,2}:[a-z_][a-z0-9_]{0,8}",
                                           fullmatch=True)
    if kind == "key":
        return st.text(_SAFE_CHARS, min_size=1, max_size=40) | _ODD_TEXT
    return st.text(_SAFE_CHARS, max_size=40) | _ODD_TEXT


def valid_value(spec: FieldSpec, free: bool = False, pretrained: str = "") -> st.SearchStrategy:
    """Values the schema accepts for ``spec`` (boundaries included).

    ``pretrained``: a real Hugging Face folder, offered for model.pretrained beside arbitrary paths
    (config validation takes any path; preflight must then load the folder or refuse the path).
    """
    tp, rule = spec.tp, spec.rule
    if spec.key == "model.pretrained" and pretrained:
        return st.just(pretrained) | _valid_text(rule)
    if spec.key == "lora.targets":  # names the tiny Llama has, or any words (refused by preflight)
        return st.lists(st.sampled_from(["q_proj", "v_proj", "o_proj", "down_proj"]), min_size=1, max_size=3,
                        unique=True) | _valid_text(rule)
    if spec.key == "parallel.wrap":  # a validate() rule beyond the schema: a word or a block count
        return st.sampled_from(["block", "model"]) | st.integers(1, 10**6).map(str)
    if spec.key == "train.loss_chunks":  # validate(): 'auto', 0 (off) or a number of chunks
        return st.sampled_from(["auto", "0", "off"]) | st.integers(1, 64).map(str)
    if typing.get_origin(tp) is list:  # each item under the field's rule
        (item,) = typing.get_args(tp)
        return st.lists(valid_value(FieldSpec(spec.key, item, None, rule)), max_size=3)
    if tp is bool:
        return st.booleans()
    if tp is int:
        low, high, _, _ = _bounds(rule, int)
        if free and spec.key in FREE_RANGES:
            low, high = FREE_RANGES[spec.key]
        return st.integers(low, high)
    if tp is float:
        low, high, ex_low, ex_high = _bounds(rule, float)
        if free and spec.key in FREE_RANGES:
            (low, high), ex_low, ex_high = FREE_RANGES[spec.key], False, False
        return st.floats(low, high, exclude_min=ex_low, exclude_max=ex_high, allow_nan=False, allow_infinity=False)
    if typing.get_origin(tp) is tuple:
        low, high, ex_low, ex_high = _bounds(rule, float)
        item = st.floats(low, high, exclude_min=ex_low, exclude_max=ex_high, allow_nan=False, allow_infinity=False)
        return st.tuples(*[item for _ in typing.get_args(tp)]).map(list)
    if typing.get_origin(tp) is dict:
        if free:  # options the nano GPT takes, in range
            return st.fixed_dictionaries({}, optional={"n_layer": st.integers(1, 3), "dropout": st.floats(0, 0.5)})
        return st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True),
                               st.integers(-5, 5) | st.text(max_size=10) | st.booleans(), max_size=3)
    choices = rule.resolved_choices() if rule else None
    if choices is not None:
        return st.sampled_from(sorted(choices))
    return _valid_text(rule)


_NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
_HUGE = st.sampled_from([10**20, -(10**20), 10**400, 2**63, -(2**63) - 1])
_BAD_TEXT = st.sampled_from(["a\nb", "tab\there", "nul\x00", "bell\x07", "\x7fdel", "c1\x85", "\udcff",
                             "lone \ud800 surrogate"])


def invalid_value(spec: FieldSpec) -> st.SearchStrategy:
    """Values the schema refuses for ``spec``."""
    tp, rule = spec.tp, spec.rule
    wrong_type = st.sampled_from([[1, 2], {"a": 1}]) | st.text(min_size=1, max_size=5).filter(
        lambda s: s.strip().lower() not in ("true", "false"))
    if tp is bool:
        return st.integers(-2, 2) | st.sampled_from(["yes", "true", 1.0])
    if tp is int:
        low, high, _, _ = _bounds(rule, int)
        out = [wrong_type, st.booleans(), st.floats(allow_nan=True), _HUGE.filter(lambda v: v < low or v > high)]
        if low is not None:
            out.append(st.integers(max_value=low - 1))
        if high is not None:
            out.append(st.integers(min_value=high + 1))
        return st.one_of(out)
    if tp is float:
        low, high, ex_low, ex_high = _bounds(rule, float)
        out = [wrong_type, st.booleans(), _NON_FINITE, st.just(10**400)]
        if low is not None:
            out.append(st.floats(max_value=low, exclude_max=not ex_low, allow_nan=False, allow_infinity=False))
        if high is not None:
            out.append(st.floats(min_value=high, exclude_min=not ex_high, allow_nan=False, allow_infinity=False))
        return st.one_of(out)
    if typing.get_origin(tp) is tuple:
        n = len(typing.get_args(tp))
        return st.one_of(st.lists(st.floats(0, 0.5), min_size=0, max_size=n - 1),
                         st.lists(st.floats(0, 0.5), min_size=n + 1, max_size=n + 2),
                         st.tuples(invalid_value(FieldSpec(spec.key, float, 0.0, rule)), st.floats(0, 0.5)).map(list),
                         wrong_type.filter(lambda v: not isinstance(v, list)))
    if typing.get_origin(tp) is list:  # a list holding one bad item, or no list at all
        (item,) = typing.get_args(tp)
        bad_item = invalid_value(FieldSpec(spec.key, item, None, rule))
        if item is str:  # a string is read as a comma-separated list: keep it to the bad item
            bad_item = bad_item.filter(lambda v: not (isinstance(v, list) and all(isinstance(x, str) for x in v)))
        return st.one_of(st.lists(bad_item, min_size=1, max_size=2),
                         st.sampled_from([True, 1.5, {"a": "b"}]))
    if typing.get_origin(tp) is dict:
        return st.one_of(
            st.dictionaries(st.sampled_from(["not an identifier", "1st", "a-b", ""]), st.integers(), min_size=1),
            st.fixed_dictionaries({"x": _NON_FINITE}), st.fixed_dictionaries({"x": st.just("\udcff")}),
            st.just(_deep(20)), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))
    # strings
    kind = rule.text if rule else "word"
    out = [st.sampled_from([True, 1.5, [1], {"a": "b"}])]
    choices = rule.resolved_choices() if rule else None
    if choices is not None:
        out.append(st.text(max_size=20).filter(lambda s: s not in choices))
    elif spec.key == "parallel.wrap":
        out.append(st.sampled_from(["0", "-1", "blocks", "", "1e3"]))
    elif spec.key == "train.loss_chunks":
        out.append(st.sampled_from(["-1", "lots", "", "1.5", "automatic"]))
    else:
        out.append(_BAD_TEXT if kind != "text" else st.just("\udcff"))
        out.append(st.just("x" * (TEXT_LIMITS.get(kind, 1024) + 1)))
        if kind == "name":
            out.append(st.sampled_from(["", "   ", ".", "..", "a/b", "..\\up", "/abs"]))
        if kind == "key":
            out.append(st.just(""))
        if kind == "factory":
            out.append(st.sampled_from(["nocolon", "a:b:c", "1mod:f", "mod:", ":f", "mod:f()"]))
    return st.one_of(out)


def _deep(n: int) -> dict:
    node: dict = {"leaf": 1}
    for _ in range(n):
        node = {"k": node}
    return node


# ------------------------------------------------------------------ cases
@dataclass
class Case:
    raw: dict[str, Any]  # the config as a raw dict (for from_dict and TOML delivery)
    sets: list[str]  # the same changes as --set flags, in order (for --set delivery)
    bad_set: str | None  # a malformed --set flag (only deliverable as a flag)
    valid: bool
    free: bool  # valid and only FREE fields changed: the dry run must pass
    delivery: str  # "dict", "toml" or "set"
    notes: list[str]


def _base(data: Path) -> dict[str, Any]:
    return {"name": "fuzz", "model": {"preset": "nano"},
            "data": {"path": str(data), "val_fraction": 0.5},
            "train": {"steps": 2, "micro_batch_size": 4, "eval_every": 0, "eval_batches": 1,
                      "sample_tokens": 0, "progress": False, "warmup_steps": 1}}


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _get(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return BY_KEY[key].default if key in BY_KEY else None
        node = node[part]
    return node


def toml_value(v: Any) -> str:
    """``v`` as a TOML literal (as a user would type it after --set key=)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_string(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


@st.composite
def mutation(draw, free: bool, structure: bool, pretrained: str = "") -> tuple[str, Any, bool, bool]:
    """(key, value, valid, free) of one change; structural errors bring their own key path."""
    kind = "structure" if structure else draw(st.sampled_from(["valid", "valid", "invalid"]))
    if kind == "structure":
        choice = draw(st.sampled_from(["unknown_top", "unknown_field", "section_scalar", "scalar_table",
                                       "too_deep"]))
        section = draw(st.sampled_from(SECTIONS))
        leaf = draw(st.sampled_from([f for f in FIELDS if f.key.startswith(section + ".")]))
        junk = draw(st.from_regex(r"[a-z]{1,8}_?x", fullmatch=True))
        return {"unknown_top": (junk, 1, False, False),
                "unknown_field": (f"{section}.{junk}", 1, False, False),
                "section_scalar": (section, draw(st.integers() | st.text(max_size=5)), False, False),
                "scalar_table": (leaf.key, {"a": 1}, typing.get_origin(leaf.tp) is dict, False),
                # Below a table-valued field (model.overrides) a deeper key is just an option.
                "too_deep": (f"{leaf.key}.{junk}", 1, typing.get_origin(leaf.tp) is dict, False)}[choice]
    pool = [f for f in FIELDS if f.key in FREE] if free else FIELDS
    spec = draw(st.sampled_from(pool))
    if kind == "invalid" and not free:
        return spec.key, draw(invalid_value(spec)), False, False
    return spec.key, draw(valid_value(spec, free, pretrained)), True, spec.key in FREE


def _meet_cross_field_rules(raw: dict, sets: list[str], pretrained: str) -> None:
    """Adjust a valid case to the rules config.validate() adds across fields, so that it stays valid.

    Each adjustment is appended to ``sets`` too, so every delivery (dict, TOML, --set) sees it.
    """
    def fix(key: str, value: Any) -> None:
        _set(raw, key, value)
        sets.append(f"{key}={toml_value(value)}")

    lr, min_lr = _get(raw, "train.lr"), _get(raw, "train.min_lr")
    if isinstance(lr, (int, float)) and isinstance(min_lr, (int, float)) and min_lr > lr:
        fix("train.min_lr", float(lr))  # the schedule decays from lr down to min_lr
    steps = _get(raw, "train.steps")
    start, end = _get(raw, "profile.start_step"), _get(raw, "profile.end_step")
    start = 3 if start is None else start
    end = 5 if end is None else end
    if _get(raw, "profile.enabled") and isinstance(steps, int) and end > steps:
        end = steps  # the profiled window lies inside the run
        fix("profile.end_step", end)
    if start > end:
        fix("profile.start_step", end)
    trackers = _get(raw, "log.trackers")
    if isinstance(trackers, list) and len(set(trackers)) != len(trackers):
        fix("log.trackers", list(dict.fromkeys(trackers)))
    # Pretrained weights are a Hugging Face folder (model.kind = "hf"); LoRA trains adapters on
    # one (a real folder here, so that preflight builds the peft model) and refuses sequence_parallel.
    if _get(raw, "lora.rank") and not _get(raw, "model.pretrained"):
        fix("model.pretrained", pretrained)
    if _get(raw, "model.pretrained") and _get(raw, "model.kind") != "hf":
        fix("model.kind", "hf")
    if _get(raw, "lora.rank") and _get(raw, "parallel.sequence_parallel"):
        fix("parallel.sequence_parallel", False)
    # The DPO objective trains on preference records, and preference records only with it.
    if (_get(raw, "train.objective") == "dpo") != (_get(raw, "data.kind") == "preference"):
        fix("train.objective", "dpo" if _get(raw, "data.kind") == "preference" else "lm")


def _pretrained_case(data: Path, pretrained: str, lora: bool) -> Case:
    """A valid case fine-tuning the real folder (with LoRA adapters when ``lora``)."""
    raw = _base(data)
    changes: dict[str, Any] = {"model.kind": "hf", "model.pretrained": pretrained}
    if lora:
        changes.update({"lora.rank": 4, "lora.targets": ["q_proj", "v_proj"]})
    for key, value in changes.items():
        _set(raw, key, value)
    return Case(raw, [f"{k}={toml_value(v)}" for k, v in changes.items()], None, True, False, "dict",
                [f"{k} = {v!r}" for k, v in changes.items()])


@st.composite
def cases(draw, data: Path, pretrained: str) -> Case:
    free = draw(st.booleans())
    raw = _base(data)
    sets, valid, all_free, notes = [], True, True, []
    # Up to three field changes (distinct keys), then at most one structural error, applied last
    # so that it can only spoil the case, never be masked by a later change.
    changes = draw(st.lists(mutation(free, structure=False, pretrained=pretrained), min_size=1, max_size=3,
                            unique_by=lambda m: m[0]))
    if not free and draw(st.integers(0, 3)) == 0:
        changes.append(draw(mutation(free, structure=True)))
    as_dict = True
    for key, value, ok, is_free in changes:
        valid &= ok
        all_free &= is_free
        try:
            _set(raw, key, value)
        except (TypeError, AttributeError):  # a key below a value: only a --set flag can say that
            assert not ok
            as_dict = False
        sets.append(f"{key}={toml_value(value)}")
        notes.append(f"{key} = {value!r}" + ("" if ok else "  (invalid)"))
    if valid:
        _meet_cross_field_rules(raw, sets, pretrained)
    bad_set = draw(st.sampled_from([None] * 9 + ["no-equals-sign", "=5", "train..lr=1", ".lr=1", "train.lr.x=1",
                                                 "train.steps=5\n[train]\nlr = 1", "train. lr=1", "träin.lr=1",
                                                 "train.lr=", "train.steps=[", "=", "name.x.y.z=1"]))
    if bad_set is not None:
        valid = False
        notes.append(f"--set {bad_set!r}  (invalid)")
    delivery = draw(st.sampled_from(["dict", "toml", "set"])) if as_dict else "set"
    return Case(raw, sets, bad_set, valid, valid and free and all_free, delivery, notes)


# ------------------------------------------------------------------ running a case
def _copy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_copy(v) for v in raw]
    return raw


def _raw_toml(raw: dict[str, Any]) -> bytes | None:
    """``raw`` as TOML file bytes (None when it cannot be one: lone surrogates are not UTF-8)."""
    lines, tables = [], []
    for k, v in raw.items():
        (tables if isinstance(v, dict) else lines).append((k, v))
    out = [f"{toml_string(k)} = {toml_value(v)}" for k, v in lines]
    for name, body in tables:
        out.append(f"[{toml_string(name)}]")
        out += [f"{toml_string(k)} = {toml_value(v)}" for k, v in body.items()]
    try:
        return ("\n".join(out) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return None


def _resolve(case: Case, data: Path, tmp: Path) -> RunConfig:
    """Deliver the case as a dict, a TOML file or --set flags, and resolve it."""
    extra = [case.bad_set] if case.bad_set else []
    if case.delivery == "dict" and not extra:
        return from_dict(_copy(case.raw))
    text = _raw_toml(case.raw) if case.delivery == "toml" else None
    if text is not None:
        (tmp / "case.toml").write_bytes(text)
        return load_config(str(tmp / "case.toml"), extra)
    (tmp / "base.toml").write_bytes(_raw_toml(_base(data)))
    return load_config(str(tmp / "base.toml"), [*case.sets, *extra])


_PREFLIGHT_CACHE: dict[str, str | None] = {}


def _preflight(cfg: RunConfig, world: int) -> str | None:
    """check_run's outcome: None, or the ShardwiseError's message. Anything else propagates (a bug).

    check_run reads only the model, data and parallel sections and the world size; the outcome
    of an identical input is reused (it builds a meta model: the slowest part of a case).
    """
    from shardwise.preflight import check_run

    key = repr((cfg.model, cfg.data, cfg.parallel, world))
    if key not in _PREFLIGHT_CACHE:
        try:
            check_run(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel)), world)
            _PREFLIGHT_CACHE[key] = None
        except ShardwiseError as e:
            _PREFLIGHT_CACHE[key] = str(e)
    return _PREFLIGHT_CACHE[key]


def _argv(case: Case, data: Path, tmp: Path) -> list[str]:
    """``train BASE.toml --set ...`` for the case (the flags a user would type)."""
    (tmp / "base.toml").write_bytes(_raw_toml(_base(data)))
    argv = ["train", str(tmp / "base.toml"), "--nproc", "1"]
    for s in [*case.sets, *([case.bad_set] if case.bad_set else [])]:
        argv += ["--set", s]
    return argv


@st.composite
def launch_flags(draw) -> tuple[list[str], bool]:
    """Extra `train` flags, and False when they are invalid on their own (True: they may still
    not fit the config, e.g. a strategy for another rank count)."""
    argv, ok = [], True
    nnodes = 1
    if draw(st.booleans()):
        nproc = draw(st.integers(-2, 6) | st.sampled_from([4096, 4097, 10**12]))
        argv += ["--nproc", str(nproc)]
        ok &= 1 <= nproc <= 4096
    if draw(st.booleans()):
        # A count, or an elastic range MIN:MAX (torchrun's), well- and ill-formed.
        low = draw(st.integers(-1, 3) | st.just(10**6))
        high = draw(st.none() | st.integers(0, 4))
        argv += ["--nnodes", str(low) if high is None else f"{low}:{high}"]
        ok &= 1 <= low <= 4096 and (high is None or low <= high)
        nnodes = low if high is None else max(low, high)
    if draw(st.booleans()):
        argv += ["--nnodes", draw(st.sampled_from(["two", "2:", ":2", "1:2:3"]))]
        ok = False
    # node0.invalid never resolves (RFC 6761): several nodes need an endpoint that does.
    endpoint = draw(st.none() | st.sampled_from(["localhost:29500", "[::1]:29400", "node0.invalid:29500", "host",
                                                 "host:0", "host:70000", ":29500", "h o:1", "node\n0:1"]))
    if endpoint is not None:
        argv += ["--rdzv-endpoint", endpoint]
        ok &= endpoint in ("localhost:29500", "[::1]:29400") or (endpoint == "node0.invalid:29500" and nnodes <= 1)
    elif nnodes > 1:
        ok = False  # several nodes need an endpoint
    if draw(st.booleans()):
        rank = draw(st.integers(-1, 4))
        argv += ["--node-rank", str(rank)]
        ok &= 0 <= rank < max(nnodes, 1)
    if draw(st.booleans()):
        rdzv_id = draw(st.sampled_from(["job-1", "4242", "a" * 129, "x y", "-x", ""]))
        argv += ["--rdzv-id", rdzv_id]
        ok &= rdzv_id in ("job-1", "4242", "")
    if draw(st.booleans()):
        local_addr = draw(st.sampled_from(["10.0.0.2", "node1", "", "a b", "x\ty"]))
        argv += ["--local-addr", local_addr]
        ok &= local_addr in ("10.0.0.2", "node1", "")
    if draw(st.booleans()):
        restarts = draw(st.integers(-1, 3) | st.just(10**5))
        argv += ["--max-restarts", str(restarts)]
        ok &= 0 <= restarts <= 1000
    if draw(st.booleans()):
        strategy = draw(st.sampled_from(["ddp", "fsdp", "single", "tp", "pp", "zero3", "ddpp", "", "a\tb"]))
        argv += ["--strategy", strategy]
        ok &= strategy not in ("ddpp", "", "a\tb")
    return argv, ok


def _dry_run(case: Case, data: Path, tmp: Path, flags: list[str] = ()) -> tuple[int, str]:
    argv = [*_argv(case, data, tmp), *flags, "--out", str(tmp / "never-created"), "--dry-run"]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse refusing a flag: also exit 2, one usage line
            code = int(e.code or 0)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return small_text(tmp_path_factory.mktemp("fuzzdata"))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """A tiny Llama folder (save_pretrained) whose vocabulary holds the small text's characters."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.helpers.hf import save_tiny

    return str(save_tiny(tmp_path_factory.mktemp("fuzzmodel") / "llama", "llama", vocab=128))


def test_fuzz_config_resolution_and_preflight(data, pretrained, tmp_path):
    counts: Counter = Counter()

    @settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                             HealthCheck.function_scoped_fixture])
    @given(case=cases(data, pretrained), flags=st.none() | launch_flags())
    # Always, whatever the draws: the real folder reaches preflight's meta build, with and without LoRA.
    @example(case=_pretrained_case(data, pretrained, lora=False), flags=None)
    @example(case=_pretrained_case(data, pretrained, lora=True), flags=None)
    def run(case: Case, flags: tuple[list[str], bool] | None) -> None:
        counts["cases"] += 1
        counts[f"delivery:{case.delivery}"] += 1
        where = "\n  ".join(case.notes)
        try:
            cfg = _resolve(case, data, tmp_path)
        except ShardwiseError as e:
            counts["refused"] += 1
            assert not case.valid, f"valid input refused:\n  {where}\n-> {e}"
            message = str(e)
            assert message and "\n" not in message.strip() or "TOML" in message, message
        else:
            counts["resolved"] += 1
            assert case.valid, f"invalid input accepted:\n  {where}\n-> {cfg}"
            # The resolved config writes and reads back as itself.
            path = tmp_path / "roundtrip.toml"
            path.write_text(to_toml(cfg), encoding="utf-8")
            assert load_config(str(path)) == cfg, where
            for world in (1, 2, 4):
                problem = _preflight(cfg, world)
                counts["preflight ok" if problem is None else "preflight refused"] += 1
                if cfg.model.pretrained == pretrained and problem is None:
                    counts["pretrained ok" if not cfg.lora.rank else "lora ok"] += 1
                if case.free and world == 1:
                    assert problem is None, f"free valid input refused by preflight:\n  {where}\n-> {problem}"
        if counts["cases"] % 4 == 0:
            counts["through main"] += 1
            extra, flags_ok = flags or ([], True)
            counts["with flags"] += bool(extra)
            code, err = _dry_run(case, data, tmp_path, extra)
            where += f"\n  flags: {extra}"
            assert "Traceback" not in err, f"{where}\n{err}"
            if not flags_ok:
                assert code == 2, f"invalid flags: exit {code}:\n  {where}\n{err}"
            elif extra:
                assert code in (0, 2), err
            elif case.valid and case.free:
                assert code == 0, f"free valid input failed the dry run:\n  {where}\n{err}"
            elif not case.valid:
                assert code == 2, f"invalid input: exit {code}:\n  {where}\n{err}"
                lines = err.strip().splitlines()
                assert len(lines) in (1, 2) and lines[-1].startswith(("error: ", "shardwise: error:")), err
            else:
                assert code in (0, 2), err
        assert not (tmp_path / "never-created").exists()

    run()
    print(f"\nfuzz: {dict(sorted(counts.items()))}", file=sys.stderr)
    assert counts["cases"] >= min(EXAMPLES, 500)
    assert counts["refused"] and counts["resolved"] and counts["through main"]
    # The real folder is reached: pretrained and LoRA cases get through preflight's meta build.
    assert counts["pretrained ok"] and counts["lora ok"], counts


@pytest.mark.slow
def test_fuzz_real_train(data, pretrained, tmp_path_factory, cli_env):
    """Four fuzz cases through a real `shardwise train` subprocess (nano, 1-3 steps): valid ones of
    the free fields train and exit 0, invalid ones exit 2 with one paragraph."""
    from shardwise.testing import run_command

    ran: Counter = Counter()
    encodable = lambda c: all(s.isprintable() or "\n" in s for s in c.sets) and not any(  # noqa: E731
        "\ud800" <= ch <= "\udfff" for s in [*c.sets, c.bad_set or ""] for ch in s)

    def one(case: Case) -> None:
        tmp = tmp_path_factory.mktemp("real")
        argv = [sys.executable, "-m", "shardwise", *_argv(case, data, tmp), "--out", str(tmp / "run")]
        proc = run_command(argv, env=cli_env, timeout=240)
        where = "\n  ".join(case.notes)
        assert "Traceback" not in proc.stderr, f"{where}\n{proc.stderr[-3000:]}"
        if case.free:
            ran["valid"] += 1
            assert proc.returncode == 0, f"{where}\n{proc.stderr[-3000:]}"
            assert json.loads((tmp / "run" / "summary.json").read_text())["steps"] == _get(case.raw, "train.steps")
        else:
            ran["invalid"] += 1
            assert proc.returncode == 2, f"{where}\n{proc.stderr[-3000:]}"
            assert proc.stderr.strip().splitlines()[-1].startswith(("error: ", "shardwise: error:"))

    checks = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much]
    for wanted in (lambda c: c.free, lambda c: not c.valid):  # two of each
        run = given(case=cases(data, pretrained).filter(wanted).filter(encodable))(one)
        settings(max_examples=2, suppress_health_check=checks)(run)()
    print(f"\nfuzz (real train): {dict(ran)}", file=sys.stderr)
    assert ran["valid"] >= 1 and ran["invalid"] >= 1
