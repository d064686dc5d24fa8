"""Typed run configuration: TOML recipes, dotted ``--set`` overrides, one up-front validation.

Each component takes only its own section (``ModelConfig``, ``DataConfig``, ``TrainConfig``,
``ParallelConfig``, ``CheckpointConfig``), never the whole ``RunConfig``. Nothing else in shardwise
reads raw dicts; unknown keys are errors that suggest the closest valid key.

Config objects are frozen: once loaded they are never modified. Resolving a run (the strategy
'auto' stands for, ranks per node, the run directory) returns a new object
(``dataclasses.replace``, see ``replace_in``); every degree lives in ``shardwise.layout.Layout``.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError, did_you_mean, unknown_choice

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
# "selective": every ac_every-th block; "selective-op": torchtitan's per-op policy on every block.
AC_MODES = ("none", "full", "selective", "selective-op")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# When gradients are reduced under accumulation: "step" skips the sync on all but the last
# micro-batch (no_sync); "microbatch" reduces every micro-batch (sharded strategies then never
# hold a whole unsharded gradient: less memory, one reduce-scatter per micro-batch).
GRAD_SYNC_MODES = ("step", "microbatch")
TOKEN_DTYPES = ("uint16", "uint32")  # element types of flat .bin token files
INIT_MODES = ("meta", "eager")  # how model.init builds the model (see ModelConfig.init)


@dataclass(frozen=True)
class ModelConfig:
    # gpt: the built-in character GPT; cnn: the small CIFAR CNN; hf: a transformers model built
    # from a local config.json; custom: ``factory = "module:function"`` returning an nn.Module.
    kind: str = "gpt"
    preset: str = "tiny"
    # Overrides on top of the preset, e.g. {n_layer = 2}. For ``hf``/``custom`` they are passed to
    # the builder as keyword arguments.
    overrides: dict[str, Any] = field(default_factory=dict)
    factory: str = ""
    hf_config: str = ""
    # hf: a local Hugging Face model folder (config.json + safetensors, one file or sharded with
    # model.safetensors.index.json) whose weights training starts from. Its config.json is the
    # architecture unless hf_config names the same one. "" keeps a random initialisation.
    pretrained: str = ""
    # "meta": build on the meta device, apply the strategy, then allocate and initialise (or load)
    # only each rank's shards; "eager": build the whole model on every rank first. Both give the
    # same weights for a seed; a factory that cannot run on meta is built eagerly either way.
    init: str = "meta"


@dataclass(frozen=True)
class LoraConfig:
    """``[lora]``: low-rank adapters (peft) on a frozen pretrained model; ``rank = 0`` turns them off."""

    rank: int = 0  # peft's ``r``: the adapters' inner dimension
    alpha: float = 16.0  # peft's ``lora_alpha``: the update is scaled by alpha / rank
    dropout: float = 0.0  # peft's ``lora_dropout`` on the adapters' input
    # Names of the modules that get adapters ("q_proj", "v_proj", ...); empty: peft's default for
    # the model family (q_proj and v_proj for Llama, c_attn for GPT-2).
    targets: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DataConfig:
    # shakespeare: the bundled text (or ``path``); cifar10: the python-pickle batches in ``path``;
    # text: a text/JSONL file or folder in ``path``, tokenised with ``tokenizer`` and cached;
    # tokens: a pre-tokenised .bin/.npy file (or a folder holding train.bin) in ``path``;
    # custom: ``factory = "module:function"`` returning (train_dataset, val_dataset).
    kind: str = "shakespeare"
    path: str = ""
    factory: str = ""
    val_fraction: float = 0.1  # text/tokens without val_path: the last fraction of the tokens
    num_workers: int = 0
    val_path: str = ""  # text/tokens: a separate validation file or folder
    tokenizer: str = ""  # text: a local tokenizer folder (save_pretrained layout) or tokenizer.json
    text_field: str = "text"  # text: the JSONL field holding each document
    token_dtype: str = "uint16"  # tokens: element type of .bin files (nanoGPT: uint16)
    cache_dir: str = ""  # text/tokens: where tokenised data is cached ("": ~/.cache/shardwise)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    micro_batch_size: int = 32  # per rank, per micro-batch
    grad_accum_steps: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0  # 0 disables clipping
    eval_every: int = 200  # 0: evaluate only at the end
    eval_batches: int = 20
    log_every: int = 10
    seed: int = 1337
    sample_tokens: int = 300  # 0: no text sample at the end
    progress: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = "auto"  # auto: ddp when more than one rank, else single
    nproc: int = 0  # 0: one per GPU, or 2 CPU processes when there is none
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    ac_every: int = 2  # with "selective": checkpoint every k-th block (not used by "selective-op")
    # Sharded strategies: "block" (one unit per transformer block), "model" (one unit), or an int
    # N given as a string/number for one unit per N blocks.
    wrap: str = "block"
    hsdp_shard_size: int = 0  # 0: ranks per node
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0: 2 x stages
    pp_stages_per_rank: int = 1
    pp_first_stage_fewer: int = 0
    # Data-parallel degree of the model-parallel compositions (0: world / (tp x pp)). Mesh order
    # is ("pp", "dp", "tp"): tp innermost, on consecutive ranks, i.e. the fastest link.
    dp: int = 0
    # Under tp: run norms/dropout on a sequence shard (activations tp x smaller between matmuls).
    sequence_parallel: bool = False
    # Under gradient accumulation (see GRAD_SYNC_MODES): "step" (fewest collectives) or
    # "microbatch" (FSDP/ZeRO-2 keep gradients sharded between micro-batches; for big models).
    grad_sync: str = "step"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # save every N steps; 0: only at the end and on interrupt
    keep_last: int = 2
    resume: str = ""  # "", "latest" or a path
    at_end: bool = True


@dataclass(frozen=True)
class WatchdogConfig:
    timeout_s: float = 600.0  # a rank with no progress for this long is declared hung
    collective_timeout_s: float = 1800.0
    # Opt-in: TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch's check that every rank calls the same
    # collective with matching shapes (a mismatch raises instead of hanging; slower).
    debug_collectives: bool = False


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection for shardwise's own fault-tolerance tests; never set in real runs.

    Each fault fires on the first elastic attempt only (``every_attempt`` repeats it), so a
    restarted job can show that it recovers.
    """

    kill_rank: int = -1  # this rank SIGKILLs itself ...
    kill_at_step: int = 0  # ... after this optimizer step ...
    kill_in_checkpoint: bool = False  # ... or, instead, mid-save: shards written, not published
    hang_rank: int = -1  # this rank stops participating (sleeps forever) ...
    hang_at_step: int = 0  # ... after this optimizer step
    every_attempt: bool = False


@dataclass(frozen=True)
class ProfileConfig:
    """``[profile]``: a torch.profiler trace of optimizer steps start_step..end_step (inclusive)."""

    enabled: bool = False
    # 1-based optimizer steps. The step before start_step is the profiler's warm-up (not
    # recorded); step 1 carries one-off costs (allocator, lazy init), so 3..5 is a typical window.
    start_step: int = 3
    end_step: int = 5
    ranks: list[int] = field(default_factory=list)  # global ranks that profile; empty: all
    record_shapes: bool = False  # input shapes of every op (larger trace)
    profile_memory: bool = False  # tensor allocations and frees per op
    with_stack: bool = False  # Python/C++ stacks per op (much larger trace)
    # CUDA only: record the caching allocator's history over the window and save the snapshot
    # pickle that pytorch.org/memory_viz reads (skipped, with a log line, on the CPU).
    memory_snapshot: bool = True
    snapshot_max_entries: int = 100_000


TRACKERS = ("tensorboard", "wandb", "mlflow", "csv")


@dataclass(frozen=True)
class LogConfig:
    """``[log]``: experiment trackers fed by rank 0, beside the always-on metrics.jsonl."""

    trackers: list[str] = field(default_factory=list)  # any of TRACKERS
    project: str = ""  # W&B project / MLflow experiment name (default: the run's name)
    # "" follows WANDB_MODE when the user set it, else "offline" (nothing leaves the machine).
    wandb_mode: str = ""
    # "" follows MLFLOW_TRACKING_URI when set, else a file store in <run dir>/mlruns.
    mlflow_tracking_uri: str = ""


@dataclass(frozen=True)
class RunConfig:
    name: str = "gpt-shakespeare"
    out_dir: str = ""  # default: runs/<name>-<strategy>-<timestamp>
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    log: LogConfig = field(default_factory=LogConfig)


# --------------------------------------------------------------------------- loading


def builtin_recipes() -> dict[str, str]:
    """Map built-in recipe names to their TOML text."""
    return dict(_builtin_recipes())


@functools.cache
def _builtin_recipes() -> dict[str, str]:
    # Package data does not change while the process runs: read it once.
    pkg = resources.files("shardwise") / "recipes"
    return {p.name[: -len(".toml")]: p.read_text() for p in pkg.iterdir() if p.name.endswith(".toml")}


def _parse_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}. Fix the syntax and retry.") from None


def load_raw(recipe_or_path: str | None) -> dict[str, Any]:
    """Return the raw dict of a built-in recipe name or a TOML file path (default recipe if None)."""
    recipes = builtin_recipes()
    name = recipe_or_path or "gpt-shakespeare"
    if name in recipes:
        return _parse_toml(recipes[name], f"built-in recipe {name!r}")
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        return _parse_toml(path.read_text(), f"config file {str(path)!r}")
    raise unknown_choice("recipe", name, recipes)


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``a.b=c`` into (``"a.b"``, value), reading the value as TOML when it parses as one."""
    if "=" not in item:
        raise ConfigError(f"--set expects key.path=value, got {item!r}.")
    key, _, raw = item.partition("=")
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words are strings: --set parallel.strategy=fsdp
    return key, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, value = parse_override(item)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is a value, not a section.")
        node[parts[-1]] = value
    return raw


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp in (int, float, str):
        if isinstance(value, tp) and not isinstance(value, bool):
            return value
        if tp is str and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # --set parallel.wrap=2 parses as an integer
    elif origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (list, tuple)):
            return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        if item is str and isinstance(value, str):
            # --set log.trackers=tensorboard,csv (a bare word is a string, not a TOML list)
            return [v.strip() for v in value.split(",") if v.strip()]
        example = '["a", "b"]' if item is str else "[0, 1]"
        want = f"a list of {item.__name__} (e.g. {example})"
        raise ConfigError(f"{key} must be {want}, got {value!r} ({type(value).__name__}).")
    else:  # pragma: no cover - only the types above are used
        return value
    want = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{key} must be {want}, got {value!r} ({type(value).__name__}).")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow (it evaluates annotations): once per section class


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(
                f"unknown config key {full!r}.{did_you_mean(key, fields)} "
                f"Valid keys in [{prefix.rstrip('.') or 'top level'}]: {', '.join(fields)}."
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{full!r} is a section; set its keys, e.g. {full}.<key>=value.")
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def replace_in(cfg: RunConfig, **changes: Any) -> RunConfig:
    """Return a copy of ``cfg`` with dotted keys changed, e.g. ``replace_in(cfg, **{"parallel.nproc": 4})``.

    ``cfg`` itself is left as it was (config objects are frozen).
    """
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        if section:
            sections.setdefault(section, {})[name] = value
        else:
            top[name] = value
    for section, values in sections.items():
        top[section] = dataclasses.replace(getattr(cfg, section), **values)
    return dataclasses.replace(cfg, **top)


def load_config(recipe_or_path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load, override and validate a run config; raises ConfigError naming any bad key or value."""
    raw = apply_overrides(load_raw(recipe_or_path), list(overrides or []))
    cfg = _build(RunConfig, raw, "")
    validate(cfg)
    return cfg


def from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = _build(RunConfig, raw, "")
    validate(cfg)
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: RunConfig) -> str:
    """Serialise a config as TOML (the resolved ``config.toml`` of a run directory)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {fmt(x)}" for k, x in v.items()) + "}"
        raise TypeError(type(v))

    lines, sections = [], []
    for key, value in to_dict(cfg).items():
        if isinstance(value, dict) and key != "overrides":
            sections.append((key, value))
        else:
            lines.append(f"{key} = {fmt(value)}")
    for name, body in sections:
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {fmt(v)}" for k, v in body.items())
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- validation


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be {bound}, got {value}.")


def validate(cfg: RunConfig) -> None:
    """Check values that do not need to know the world size; never modifies ``cfg``.

    What needs the world size (degrees, the strategy 'auto' stands for, pipeline micro-batches) is
    resolved by ``shardwise.layout.resolve_layout``, which returns a new object.
    """
    from shardwise.parallel.registry import canonical_strategy

    t, p = cfg.train, cfg.parallel
    _positive("train.steps", t.steps)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.grad_accum_steps", t.grad_accum_steps)
    _positive("train.lr", t.lr)
    _positive("train.min_lr", t.min_lr, allow_zero=True)
    _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive("train.grad_clip", t.grad_clip, allow_zero=True)
    _positive("train.eval_every", t.eval_every, allow_zero=True)
    _positive("train.eval_batches", t.eval_batches)
    _positive("train.log_every", t.log_every)
    _positive("parallel.nproc", p.nproc, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    _positive("watchdog.timeout_s", cfg.watchdog.timeout_s)
    _positive("watchdog.collective_timeout_s", cfg.watchdog.collective_timeout_s)
    _positive("debug.kill_at_step", cfg.debug.kill_at_step, allow_zero=True)
    _positive("debug.hang_at_step", cfg.debug.hang_at_step, allow_zero=True)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be between 0 and 1, got {cfg.data.val_fraction}.")
    if cfg.data.token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype must be one of {', '.join(TOKEN_DTYPES)} (the element type "
                          f"of .bin token files), got {cfg.data.token_dtype!r}.")
    if not cfg.data.text_field:
        raise ConfigError("data.text_field must name the JSONL field holding each document's text, got ''.")
    if p.precision not in PRECISIONS:
        raise unknown_choice("precision", p.precision, PRECISIONS)
    if p.activation_checkpointing not in AC_MODES:
        raise unknown_choice("activation_checkpointing mode", p.activation_checkpointing, AC_MODES)
    _positive("parallel.ac_every", p.ac_every)
    if p.wrap not in ("block", "model") and not (str(p.wrap).isdigit() and int(p.wrap) >= 1):
        raise ConfigError(f"parallel.wrap must be 'block', 'model' or a number of blocks, got {p.wrap!r}.")
    from shardwise.parallel.precision import check_precision

    check_precision(p.precision)  # e.g. bf16 on a GPU without bfloat16, before any rank starts
    canonical_strategy(p.strategy)  # raises with the list of valid names; resolve_layout picks the one
    _positive("parallel.tp", p.tp)
    _positive("parallel.pp", p.pp)
    _positive("parallel.dp", p.dp, allow_zero=True)
    _positive("parallel.pp_microbatches", p.pp_microbatches, allow_zero=True)
    _positive("parallel.pp_stages_per_rank", p.pp_stages_per_rank)
    _positive("parallel.pp_first_stage_fewer", p.pp_first_stage_fewer, allow_zero=True)
    if p.pp_schedule not in PP_SCHEDULES:
        raise unknown_choice("pipeline schedule", p.pp_schedule, PP_SCHEDULES)
    if p.grad_sync not in GRAD_SYNC_MODES:
        raise unknown_choice("parallel.grad_sync mode", p.grad_sync, GRAD_SYNC_MODES)
    _validate_profile(cfg.profile, t.steps)
    _validate_log(cfg.log)
    _validate_model(cfg.model, cfg.lora)
    if cfg.lora.rank and p.sequence_parallel:
        raise ConfigError("LoRA adapters do not run with parallel.sequence_parallel: the adapters' matmuls would "
                          "need their own sequence-parallel layouts. Unset sequence_parallel (tensor parallel "
                          "alone works with LoRA).")


def _validate_model(mc: ModelConfig, lc: LoraConfig) -> None:
    if mc.init not in INIT_MODES:
        raise unknown_choice("model.init mode", mc.init, INIT_MODES)
    if mc.pretrained and mc.kind != "hf":
        raise ConfigError(f"model.pretrained = {mc.pretrained!r} loads a Hugging Face folder, which needs "
                          f"model.kind = 'hf' (it is {mc.kind!r}).")
    _positive("lora.rank", lc.rank, allow_zero=True)
    _positive("lora.alpha", lc.alpha)
    if not 0.0 <= lc.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lc.dropout}.")
    if any(not t.strip() for t in lc.targets):
        raise ConfigError(f"lora.targets must list module names such as 'q_proj', got {lc.targets!r}.")
    if lc.rank and not (mc.kind == "hf" and mc.pretrained):
        raise ConfigError(
            "lora.rank > 0 trains adapters on a frozen pretrained model: set model.kind = 'hf' and "
            "model.pretrained = 'path/to/hf-folder' (or set lora.rank = 0 to train every weight).")


def _validate_profile(pc: ProfileConfig, steps: int) -> None:
    _positive("profile.start_step", pc.start_step)
    _positive("profile.end_step", pc.end_step)
    _positive("profile.snapshot_max_entries", pc.snapshot_max_entries)
    if pc.end_step < pc.start_step:
        raise ConfigError(f"profile.end_step ({pc.end_step}) must be >= profile.start_step "
                          f"({pc.start_step}): the profiled window is steps start_step..end_step.")
    if pc.enabled and pc.end_step > steps:
        raise ConfigError(f"profile.end_step ({pc.end_step}) is after the last step (train.steps = "
                          f"{steps}); profile steps inside 1..{steps}.")
    for r in pc.ranks:
        _positive("profile.ranks entry", r, allow_zero=True)


def _validate_log(lc: LogConfig) -> None:
    for name in lc.trackers:
        if name not in TRACKERS:
            raise unknown_choice("tracker", name, TRACKERS)
    if len(set(lc.trackers)) != len(lc.trackers):
        raise ConfigError(f"log.trackers lists a tracker twice: {lc.trackers}.")
    if lc.wandb_mode not in ("", "offline", "online", "disabled"):
        raise unknown_choice("log.wandb_mode", lc.wandb_mode, ("offline", "online", "disabled"))
