"""Typed run configuration: TOML recipes, dotted ``--set`` overrides, one up-front validation.

Each component takes only its own section (``ModelConfig``, ``DataConfig``, ``TrainConfig``,
``ParallelConfig``, ``CheckpointConfig``), never the whole ``RunConfig``. Nothing else in shardwise
reads raw dicts; unknown keys are errors that suggest the closest valid key.

Config objects are frozen: once loaded they are never modified. Resolving a run (the strategy
'auto' stands for, ranks per node, the run directory) returns a new object
(``dataclasses.replace``, see ``replace_in``); every degree lives in ``shardwise.core.layout.Layout``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import typing
import unicodedata
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.core.config_version import CONFIG_VERSION, upgrade
from shardwise.core.families import DATA_KINDS, MODEL_KINDS, PACK_MODES, packs
from shardwise.core.strategies import (  # modes live with the degrees (re-exported)
    AC_MODES,
    GRAD_SYNC_MODES,
    PP_SCHEDULES,
    canonical_strategy,
    strategy_names,
)
from shardwise.errors import ConfigError, did_you_mean, unknown_choice
from shardwise.habits import other_tools_hint
from shardwise.optim.names import MUON_LR_ADJUST, ON_SWITCH, OPTIMIZER_NAMES, SCHEDULE_NAMES
from shardwise.optim.schedule import check_schedule

AUTO = "auto"
# "auto": bf16-mixed on GPUs with bfloat16, fp32 elsewhere (shardwise.runtime.auto decides).
PRECISIONS = ("auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
# train.compile: "auto" compiles where the run is long enough to pay the compile time back
# (shardwise.runtime.auto); TOML true/false read as "true"/"false".
COMPILE_MODES = ("auto", "true", "false")
# The names Lightning Fabric (precision="bf16-mixed", "16-mixed", "32-true", ...) and Accelerate
# (mixed_precision="bf16", "fp16", "no") users already type; they become the canonical name when
# the config is loaded. Plain "bf16" means bf16 autocast there, hence bf16-mixed here.
PRECISION_ALIASES = (
    ("bf16", "bf16-mixed"), ("bf16_mixed", "bf16-mixed"), ("16-mixed", "fp16-mixed"), ("16", "fp16-mixed"),
    ("fp16", "fp16-mixed"), ("fp16_mixed", "fp16-mixed"), ("32-true", "fp32"), ("32", "fp32"),
    ("no", "fp32"), ("float32", "fp32"), ("bf16_true", "bf16-true"),
)
TOKEN_DTYPES = ("uint16", "uint32")  # element types of flat .bin token files
INIT_MODES = ("meta", "eager")  # how model.init builds the model (see ModelConfig.init)
# How checkpoints are written (CheckpointConfig.mode; runtime.checkpoint.background resolves "auto").
CHECKPOINT_MODES = ("auto", "sync", "async", "async-pinned")
ATTENTION_MODES = ("mask", "varlen")  # how a Hugging Face model attends within packed documents (ModelConfig)
TRACKERS = ("tensorboard", "wandb", "mlflow", "csv")
WANDB_MODES = ("", "offline", "online", "disabled")
NONFINITE_MODES = ("stop", "skip")
OBJECTIVES = ("lm", "dpo")  # train.objective
PREFERENCE_LOSSES = ("sigmoid", "ipo")  # preference.loss (shardwise.preference.objective)
LOG_LEVELS = ("debug", "info", "warning", "error")  # shardwise.logs.LEVELS

# Sane upper bounds: far beyond any real job, small enough that a typo (an extra dozen zeros)
# is an error instead of a job that never ends.
MAX_STEPS = 10**9
MAX_RANKS = 2**16
WEEK_S = 7 * 86400.0
# The watchdog's allowance for a rank's first optimizer step (compile, communicators, allocator).
FIRST_STEP_TIMEOUT_S = 1800.0
MAX_SEED = 2**32 - 1


# --------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """Where a config value may lie, declared next to its field (``field(metadata={"rule": ...})``).

    Numbers: ``ge``/``le`` inclusive and ``gt``/``lt`` exclusive bounds (floats must also be finite,
    always). Strings: ``choices`` (a tuple of the valid names, imported from the module that owns them)
    and ``text``: "name" (a file-name-safe word), "path", "factory" (``module:function`` or empty),
    "key" (a non-empty word, e.g. a JSONL field name) or "word". Every string is checked to be
    UTF-8 text without control characters. Tuples apply the rule to each element. Fields without
    a rule still get the type, finiteness and text checks.
    Config validation, the CLI's messages and the fuzzer (tests/test_fuzz_config.py) all read these.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    label: str = ""  # what the choices are, for "unknown <label> 'x'" messages
    text: str = "word"
    aliases: tuple[tuple[str, str], ...] = ()  # (other name, canonical choice), applied at load time

    def canonical(self, value: Any) -> Any:
        """``value`` with an alias replaced by its canonical choice (case-insensitively); else unchanged."""
        if isinstance(value, str) and self.aliases:
            return dict(self.aliases).get(value.strip().lower(), value)
        return value

    def resolved_choices(self) -> tuple[str, ...] | None:
        """The valid names, or None when any value goes."""
        return self.choices

    def describe(self) -> str:
        """'between 0 and 1 (exclusive)', '> 0 and <= 10', ... for messages."""
        low = (">=", self.ge) if self.ge is not None else (">", self.gt) if self.gt is not None else None
        high = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        fmt = lambda v: f"{v:g}" if isinstance(v, float) and not v.is_integer() else str(int(v))  # noqa: E731
        if low and high and low[0] == ">=" and high[0] == "<=":
            return f"between {fmt(low[1])} and {fmt(high[1])}"
        if low and high and low[0] == ">" and high[0] == "<":
            return f"between {fmt(low[1])} and {fmt(high[1])} (exclusive)"
        return " and ".join(f"{b[0]} {fmt(b[1])}" for b in (low, high) if b)

    def bounds_problem(self, value: float) -> bool:
        """True when ``value`` lies outside the bounds."""
        return ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt))


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            **rule: Any) -> Any:
    """A dataclass field with its validation ``Rule`` (see ``Rule``)."""
    return field(default=default, default_factory=default_factory, metadata={"rule": Rule(**rule)})


def rule_of(f: dataclasses.Field) -> Rule | None:
    """The ``Rule`` declared on a config field (None when it has none)."""
    return f.metadata.get("rule")


COUNT = {"gt": 0, "le": MAX_STEPS}  # a positive count of steps/batches
EVERY = {"ge": 0, "le": MAX_STEPS}  # an interval in steps, 0 meaning "off"


@dataclass(frozen=True)
class ModelConfig:
    # gpt: the built-in character GPT; cnn: the small CIFAR CNN; hf: a transformers model built
    # from a local config.json; custom: ``factory = "module:function"`` returning an nn.Module.
    kind: str = setting("gpt", choices=MODEL_KINDS, label="model kind")
    preset: str = setting("tiny", text="word")
    # Overrides on top of the preset, e.g. {n_layer = 2}. For ``hf``/``custom`` they are passed to
    # the builder as keyword arguments (checked against its signature before any rank starts).
    overrides: dict[str, Any] = field(default_factory=dict)
    factory: str = setting("", text="factory")
    hf_config: str = setting("", text="path")
    # hf: a local Hugging Face model folder (config.json + safetensors, one file or sharded with
    # model.safetensors.index.json) whose weights training starts from, or a PEFT LoRA adapter folder
    # (adapter_config.json + adapter_model.safetensors) merged into the local base folder it names.
    # Its config.json is the architecture unless hf_config names the same one. "" keeps a random
    # initialisation.
    pretrained: str = setting("", text="path")
    # "meta": build on the meta device, apply the strategy, then allocate and initialise (or load)
    # only each rank's shards; "eager": build the whole model on every rank first. Both give the
    # same weights for a seed; a factory that cannot run on meta is built eagerly either way.
    init: str = setting("meta", choices=INIT_MODES, label="model.init mode")
    # hf, packed batches (doc ids): "mask" hands transformers a (B, 1, T, T) document mask (SDPA;
    # every strategy); "varlen" attends document by document from their cu_seqlens with no T x T
    # mask (models/varlen.py: torch's FlashAttention varlen kernel on CUDA in bf16/fp16, one SDPA
    # call per document elsewhere). Context parallel needs "mask".
    attention: str = setting("mask", choices=ATTENTION_MODES, label="model.attention")


@dataclass(frozen=True)
class LoraConfig:
    """``[lora]``: low-rank adapters (peft) on a frozen pretrained model; ``rank = 0`` turns them off."""

    rank: int = setting(0, ge=0, le=4096)  # peft's ``r``: the adapters' inner dimension
    alpha: float = setting(16.0, gt=0.0, le=1e6)  # peft's ``lora_alpha``: the update is scaled by alpha / rank
    dropout: float = setting(0.0, ge=0.0, lt=1.0)  # peft's ``lora_dropout`` on the adapters' input
    # Names of the modules that get adapters ("q_proj", "v_proj", ...); empty: peft's default for
    # the model family (q_proj and v_proj for Llama, c_attn for GPT-2).
    targets: list[str] = setting(default_factory=list, text="key")


@dataclass(frozen=True)
class DataConfig:
    # shakespeare: the bundled text (or ``path``); cifar10: the python-pickle batches in ``path``;
    # text: a text/JSONL file or folder in ``path``, tokenised with ``tokenizer`` and cached;
    # tokens: a pre-tokenised .bin/.npy file (or a folder holding train.bin) in ``path``;
    # custom: ``factory = "module:function"`` returning (train_dataset, val_dataset).
    kind: str = setting("shakespeare", choices=DATA_KINDS, label="data kind")
    path: str = setting("", text="path")
    factory: str = setting("", text="factory")
    # text/tokens without val_path: the last fraction of the tokens; chat/instruct: a seeded choice of records
    val_fraction: float = setting(0.1, gt=0.0, lt=1.0)
    num_workers: int = setting(0, ge=0, le=256)
    val_path: str = setting("", text="path")  # text/tokens: a separate validation file or folder
    # text: a local tokenizer folder (save_pretrained layout) or a tokenizer.json
    tokenizer: str = setting("", text="path")
    text_field: str = setting("text", text="key")  # text: the JSONL field holding each document
    # tokens: element type of .bin files (nanoGPT: uint16)
    token_dtype: str = setting("uint16", choices=TOKEN_DTYPES, label="data.token_dtype")
    cache_dir: str = setting("", text="path")  # text/tokens: the tokenised-data cache ("": ~/.cache/shardwise)
    # --- chat/instruct records (see shardwise.data.instruct) ---
    # Record fields; "" = the first present of prompt/instruction/question and response/completion/output/answer.
    prompt_field: str = setting("", text="word")
    response_field: str = setting("", text="word")
    system_field: str = setting("system", text="key")  # optional per-record system prompt
    input_field: str = setting("input", text="key")  # optional per-record input (Alpaca's instruction/input/output)
    messages_field: str = setting("messages", text="key")  # chat: the list of {role, content} turns
    # "": the tokenizer's own chat template (instruct records: plain prompt + response if it has none);
    # "none": never a template (instruct only); else a Jinja template file.
    chat_template: str = setting("", text="path")
    train_on_prompt: bool = False  # chat/instruct: also train on prompt/template tokens (default: response only)
    # chat/instruct: a record longer than the sequence is cut on the right, dropped, or an error
    truncation: str = setting("right", choices=("right", "drop", "error"), label="data.truncation")
    # text/chat/instruct: several documents per sequence, positions reset and attention kept within each.
    # "auto": packed for chat/instruct records, not for text (families.packs owns the rule); true/false.
    pack: str = setting("auto", choices=PACK_MODES, label="data.pack")

    @property
    def packed(self) -> bool:
        """Whether this data is packed (``data.pack`` resolved for its kind)."""
        return packs(self.kind, self.pack)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = setting(600, **COUNT)
    micro_batch_size: int = setting(32, gt=0, le=2**20)  # per rank, per micro-batch
    grad_accum_steps: int = setting(1, gt=0, le=2**16)
    lr: float = setting(3e-3, gt=0.0, le=10.0)
    min_lr: float = setting(3e-4, ge=0.0, le=10.0)  # and <= lr
    warmup_steps: int = setting(30, **EVERY)
    weight_decay: float = setting(0.1, ge=0.0, le=100.0)
    betas: tuple[float, float] = setting((0.9, 0.99), ge=0.0, lt=1.0)
    grad_clip: float = setting(1.0, ge=0.0, le=1e6)  # 0 disables clipping
    eval_every: int = setting(200, **EVERY)  # 0: evaluate only at the end
    eval_batches: int = setting(20, gt=0, le=10**6)
    log_every: int = setting(10, **COUNT)
    seed: int = setting(1337, ge=0, le=MAX_SEED)
    sample_tokens: int = setting(300, ge=0, le=100_000)  # 0: no text sample at the end
    progress: bool = True
    # A non-finite (NaN/inf) loss or gradient norm: "stop" ends the run (exit code 4) naming the
    # first bad step and the last good checkpoint; "skip" skips that optimizer step, counts it, and
    # gives up after ``max_nonfinite_skips`` skips in a row.
    nonfinite: str = setting("stop", choices=NONFINITE_MODES, label="train.nonfinite mode")
    max_nonfinite_skips: int = setting(10, gt=0, le=10**6)
    # torch.compile each transformer block (and the loss), after TP and activation checkpointing,
    # before DDP/FSDP (torchtitan's order; see shardwise.parallel.compile). CPU: inductor's C++.
    # "auto": on where the run pays the compile time back (shardwise.runtime.auto); true/false.
    compile: str = setting("auto", choices=COMPILE_MODES, label="train.compile")
    # Output head + cross-entropy over chunks of tokens, so the whole [tokens, vocab] logits never
    # exist (shardwise.loss): "auto" (on where it runs and the vocabulary is > 4 x hidden), 0 off,
    # or a number of chunks per micro-batch.
    loss_chunks: str = setting("auto", text="word")
    # "lm": next-token cross-entropy; "dpo": preference tuning on chosen/rejected pairs (data.kind =
    # "preference"; the [preference] section; shardwise.preference).
    objective: str = setting("lm", choices=OBJECTIVES, label="train.objective")


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer trains the model (shardwise.optim.build). Learning rate, betas and weight decay
    stay in ``[train]``; weight decay applies to matrices only, for every optimizer."""

    name: str = setting("adamw", choices=OPTIMIZER_NAMES, label="optimizer")
    eps: float = setting(1e-8, gt=0.0, le=1.0)  # AdamW's (also Muon's AdamW groups)
    # sgd: momentum and Nesterov.
    momentum: float = setting(0.9, ge=0.0, lt=1.0)
    nesterov: bool = False
    # muon: hidden 2-D weights (and experts' matrices) by Muon, embeddings/head/norms/biases by AdamW.
    muon_lr: float = setting(0.0, ge=0.0, le=10.0)  # 0: train.lr (with match_rms_adamw, as Moonlight)
    muon_momentum: float = setting(0.95, ge=0.0, lt=1.0)
    muon_nesterov: bool = True
    muon_ns_steps: int = setting(5, gt=0, lt=100)
    muon_adjust_lr: str = setting("match_rms_adamw", choices=MUON_LR_ADJUST, label="optimizer.muon_adjust_lr")
    # adafactor: torch.optim.Adafactor's beta2 decay exponent.
    adafactor_beta2_decay: float = setting(-0.8, ge=-1.0, le=0.0)
    # Resuming a checkpoint saved by another optimizer: "refuse", or "reset" its state (a warning).
    on_switch: str = setting("refuse", choices=ON_SWITCH, label="optimizer.on_switch")


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate schedule (shardwise.optim.schedule); lr, min_lr and warmup_steps are in ``[train]``."""

    name: str = setting("cosine", choices=SCHEDULE_NAMES, label="schedule")
    decay_fraction: float = setting(0.2, gt=0.0, le=1.0)  # wsd: the last fraction of train.steps decays


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = setting("auto", choices=tuple(strategy_names()),
                            label="strategy")  # auto: ddp when more than one rank, else single
    nproc: int = setting(0, ge=0, le=MAX_RANKS)  # 0: one per GPU, or 2 CPU processes when there is none
    precision: str = setting("auto", choices=PRECISIONS, label="precision", aliases=PRECISION_ALIASES)
    activation_checkpointing: str = setting("none", choices=AC_MODES, label="activation_checkpointing mode")
    ac_every: int = setting(2, gt=0, le=10**4)  # with "selective": checkpoint every k-th block (not "selective-op")
    # Sharded strategies: "block" (one unit per transformer block), "model" (one unit), or an int
    # N given as a string/number for one unit per N blocks.
    wrap: str = setting("block", text="word")
    hsdp_shard_size: int = setting(0, ge=0, le=MAX_RANKS)  # 0: ranks per node
    tp: int = setting(1, gt=0, le=MAX_RANKS)
    pp: int = setting(1, gt=0, le=MAX_RANKS)
    pp_schedule: str = setting("1f1b", choices=PP_SCHEDULES, label="pipeline schedule")
    pp_microbatches: int = setting(0, ge=0, le=2**20)  # 0: 2 x stages
    pp_stages_per_rank: int = setting(1, gt=0, le=1024)
    pp_first_stage_fewer: int = setting(0, ge=0, le=10**4)
    # How context parallel runs attention (shardwise.parallel.context.cp): "alltoall" (Ulysses, any device),
    # "ring" (torch's context_parallel, CUDA only), "auto" (the one the device runs).
    cp_impl: str = setting("auto", choices=("auto", "alltoall", "ring"), label="parallel.cp_impl")
    # Data-parallel degree of the model-parallel compositions (0: world / (tp x pp)). Mesh order
    # is ("pp", "dp", "tp"): tp innermost, on consecutive ranks, i.e. the fastest link.
    dp: int = setting(0, ge=0, le=MAX_RANKS)
    # The degrees directly (torchtitan's ParallelDims): 0 = not given. With strategy 'auto' they
    # select the strategy (dp_shard=2, tp=2 is 'fsdp+tp'); with a named strategy they must agree
    # with it. shardwise.core.layout owns every rule on them (products, divisibility, order).
    dp_replicate: int = setting(0, ge=0, le=MAX_RANKS)
    dp_shard: int = setting(0, ge=0, le=MAX_RANKS)
    # Context parallel: cp ranks share the data-parallel index and each keeps seq / cp tokens of every
    # sequence (shardwise.parallel.context.cp); they are part of the data-parallel dimension, which DDP/FSDP
    # average gradients over: FSDP shards over dp_shard x cp.
    cp: int = setting(1, gt=0, le=MAX_RANKS)
    # Expert parallel: MoE experts split over groups of ep ranks borrowed from the data-parallel
    # shard ranks (torchtitan's layout); 1: off. Checked by the layout (Layout._check_ep).
    ep: int = setting(1, gt=0, le=MAX_RANKS)
    # Under tp: run norms/dropout on a sequence shard (activations tp x smaller between matmuls).
    sequence_parallel: bool = False
    # Under gradient accumulation (see GRAD_SYNC_MODES): "step" (fewest collectives) or
    # "microbatch" (FSDP/ZeRO-2 keep gradients sharded between micro-batches; for big models).
    grad_sync: str = setting("step", choices=GRAD_SYNC_MODES, label="parallel.grad_sync mode")
    # DeepSpeed kinds (parallel/deepspeed/strategy.py): zero3-nvme's swap directory, and the
    # user's ds_config.json for strategy "deepspeed" ("auto" values filled from this config).
    nvme_path: str = setting("", text="path")
    deepspeed_config: str = setting("", text="path")


@dataclass(frozen=True)
class PreferenceConfig:
    """``[preference]``: the DPO objective (``train.objective = "dpo"``; see shardwise.preference)."""

    beta: float = setting(0.1, gt=0.0, le=1e3)  # the KL strength: rewards are beta x log(pi / ref)
    label_smoothing: float = setting(0.0, ge=0.0, lt=0.5)  # conservative DPO: the labels' assumed noise
    loss: str = setting("sigmoid", choices=PREFERENCE_LOSSES, label="preference.loss")  # sigmoid (DPO) or ipo
    # Score the reference once before training and keep its log-probs with the data (no second model);
    # otherwise the reference is the model with its LoRA adapters off, or a frozen copy sharded like it.
    precompute_reference: bool = False
    chosen_field: str = setting("chosen", text="key")
    rejected_field: str = setting("rejected", text="key")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = setting(0, **EVERY)  # save every N steps; 0: only at the end and on interrupt
    keep_last: int = setting(2, gt=0, le=10**6)
    resume: str = setting("", text="path")  # "", "latest", "auto" or a path
    at_end: bool = True
    # sync: the step waits for the whole write; async: the step waits only while the state is
    # copied to host memory, the write goes on in the background (async-pinned: into pinned
    # memory on CUDA); auto: async, except under DeepSpeed (sync). See docs/checkpoints.md.
    mode: str = setting("auto", choices=CHECKPOINT_MODES, label="checkpoint.mode")


@dataclass(frozen=True)
class WatchdogConfig:
    # A rank with no progress for this long is declared hung.
    timeout_s: float = setting(600.0, ge=1.0, le=WEEK_S)
    # ... except before a rank's first optimizer step after a start or a resume (loading the
    # checkpoint, compiling, building communicators), which may take this long (at least timeout_s).
    first_step_timeout_s: float = setting(FIRST_STEP_TIMEOUT_S, ge=1.0, le=WEEK_S)
    collective_timeout_s: float = setting(1800.0, ge=1.0, le=WEEK_S)
    # Opt-in: TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch's check that every rank calls the same
    # collective with matching shapes (a mismatch raises instead of hanging; slower).
    debug_collectives: bool = False


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection for shardwise's own fault-tolerance tests; never set in real runs.

    Each fault fires on the first elastic attempt only (``every_attempt`` repeats it), so a
    restarted job can show that it recovers.
    """

    kill_rank: int = setting(-1, ge=-1, le=MAX_RANKS)  # this rank SIGKILLs itself ...
    kill_at_step: int = setting(0, **EVERY)  # ... after this optimizer step ...
    kill_in_checkpoint: bool = False  # ... or, instead, mid-save: shards written, not published
    kill_launcher: bool = False  # that rank SIGKILLs its launcher instead of itself (the whole job goes)
    hang_rank: int = setting(-1, ge=-1, le=MAX_RANKS)  # this rank stops participating (sleeps forever) ...
    hang_at_step: int = setting(0, **EVERY)  # ... after this optimizer step
    # The loss becomes NaN at this step (1-based; 0: never) for ``nan_loss_steps`` steps, on
    # ``nan_loss_rank`` (-1: every rank).
    nan_loss_at_step: int = setting(0, **EVERY)
    nan_loss_steps: int = setting(1, gt=0, le=MAX_STEPS)
    nan_loss_rank: int = setting(-1, ge=-1, le=MAX_RANKS)
    every_attempt: bool = False


@dataclass(frozen=True)
class ProfileConfig:
    """``[profile]``: a torch.profiler trace of optimizer steps start_step..end_step (inclusive)."""

    enabled: bool = False
    # 1-based optimizer steps. The step before start_step is the profiler's warm-up (not
    # recorded); step 1 carries one-off costs (allocator, lazy init), so 3..5 is a typical window.
    start_step: int = setting(3, **COUNT)
    end_step: int = setting(5, **COUNT)
    # global ranks that profile; empty: all
    ranks: list[int] = setting(default_factory=list, ge=0, le=MAX_RANKS)
    record_shapes: bool = False  # input shapes of every op (larger trace)
    profile_memory: bool = False  # tensor allocations and frees per op
    with_stack: bool = False  # Python/C++ stacks per op (much larger trace)
    # CUDA only: record the caching allocator's history over the window and save the snapshot
    # pickle that pytorch.org/memory_viz reads (skipped, with a log line, on the CPU).
    memory_snapshot: bool = True
    snapshot_max_entries: int = setting(100_000, gt=0, le=10**8)


@dataclass(frozen=True)
class LogConfig:
    """``[log]``: experiment trackers fed by rank 0, beside the always-on metrics.jsonl; the level
    and ranks of shardwise's own log lines."""

    trackers: list[str] = setting(default_factory=list, choices=TRACKERS, label="tracker")
    project: str = setting("", text="word")  # W&B project / MLflow experiment name (default: the run's name)
    # "" follows WANDB_MODE when the user set it, else "offline" (nothing leaves the machine).
    wandb_mode: str = setting("", choices=WANDB_MODES, label="log.wandb_mode")
    # "" follows MLFLOW_TRACKING_URI when set, else a file store in <run dir>/mlruns.
    mlflow_tracking_uri: str = setting("", text="path")
    # shardwise's log lines (stdlib logging, logger "shardwise"; see shardwise.logs): the level,
    # and whether every rank logs (each line tagged [rank R]) or rank 0 only.
    level: str = setting("info", choices=LOG_LEVELS, label="log.level")
    all_ranks: bool = False


@dataclass(frozen=True)
class RunConfig:
    name: str = setting("gpt-shakespeare", text="name")
    out_dir: str = setting("", text="path")  # default: runs/<name>-<strategy>-<timestamp>
    # The meaning the file's keys have (shardwise.core.config_version): written into every run's config.toml.
    config_version: int = setting(CONFIG_VERSION, ge=1, le=CONFIG_VERSION)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
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
    check_text("the recipe", name, kind="path")
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}.") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {data[e.start]:#04x} at "
                              f"position {e.start}); TOML files are UTF-8. Is it the right file?") from None
        return _parse_toml(text, f"config file {str(path)!r}")
    raise unknown_choice("recipe", name, recipes)


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``a.b=c`` into (``"a.b"``, value), reading the value as TOML when it parses as one."""
    if "=" not in item:
        raise ConfigError(f"--set expects key.path=value, got {item!r}.")
    key, _, raw = item.partition("=")
    key = key.strip()
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        parsed = {}
    # Anything but exactly one TOML value (e.g. "5\n[train]\nlr = 1") is taken as a string, never
    # half-read: bare words are strings (--set parallel.strategy=fsdp).
    value = parsed["v"] if set(parsed) == {"v"} else raw
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
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key} = {str(value)[:40]}... is too large a number.") from None
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
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
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
        raise ConfigError(f"{key} must be {want}, got {_show(value)} ({type(value).__name__}).")
    else:  # pragma: no cover - only the types above are used
        return value
    want = getattr(tp, "__name__", str(tp))
    if origin is tuple:
        want = f"a list of {len(typing.get_args(tp))} {typing.get_args(tp)[0].__name__}s"
    raise ConfigError(f"{key} must be {want}, got {_show(value)} ({type(value).__name__}).")


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
                f"unknown config key {full!r}.{did_you_mean(key, fields)}{other_tools_hint(full)} "
                f"Valid keys in [{prefix.rstrip('.') or 'top level'}]: {', '.join(fields)}."
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{full!r} is a section; set its keys, e.g. {full}.<key>=value.")
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            rule = rule_of(fields[key])
            if tp is str and isinstance(value, bool) and rule is not None and rule.choices \
                    and {"true", "false"} <= set(rule.choices):
                value = "true" if value else "false"  # a word setting that also takes TOML true/false (data.pack)
            value = _coerce(value, tp, full)
            kwargs[key] = rule.canonical(value) if rule is not None else value
    return cls(**kwargs)


def load_config(recipe_or_path: str | None = None, overrides: list[str] | None = None, *,
                check: bool = True) -> RunConfig:
    """Load, override and validate a run config; raises ConfigError naming any bad key or value.

    ``check=False``: keys and types only, not the rules between values (``train --show`` of a recipe
    whose required paths are not set yet)."""
    raw = upgrade(load_raw(recipe_or_path), repr(recipe_or_path or "gpt-shakespeare"))
    raw = apply_overrides(raw, list(overrides or []))
    cfg = _build(RunConfig, raw, "")
    if check:
        validate(cfg)
    return cfg


def from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = _build(RunConfig, raw, "")
    validate(cfg)
    return cfg


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


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_string(value: str) -> str:
    """``value`` as a TOML basic string: quotes, backslashes and every control character escaped."""
    out = []
    for c in value:
        if c in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[c])
        elif unicodedata.category(c) == "Cc":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def to_toml(cfg: RunConfig) -> str:
    """Serialise a config as TOML (the resolved ``config.toml`` of a run directory); it reads back equal."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)  # nan, inf and 1e-05 are TOML as Python prints them
        if isinstance(v, str):
            return toml_string(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{_toml_key(k)} = {fmt(x)}" for k, x in v.items()) + "}"
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


_FACTORY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_TEXT_LIMITS = {"path": 4096, "name": 200}


def check_text(key: str, value: str, kind: str = "word") -> None:
    """Raise ConfigError unless ``value`` is text a config value may hold.

    Every kind: valid UTF-8 (no lone surrogates from undecodable command-line bytes) without
    control characters (a newline in a name or path is a mistake, and no file system tool shows
    it). ``kind`` adds: "name" (a run name, used in directory names: no separators, not '.'/'..'),
    "path", "factory" ('package.module:function' or empty), "key" (a non-empty word), "word";
    "text" (values passed on to a model builder) may hold control characters: ``to_toml`` escapes them.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{key} is not valid UTF-8 text ({_show(value)}); use UTF-8 names and paths.") from None
    bad = next((c for c in value if unicodedata.category(c) == "Cc"), None) if kind != "text" else None
    if bad is not None:
        raise ConfigError(f"{key} contains the control character {bad!r} ({_show(value)}); names, "
                          "paths and words in a config may not hold control characters.")
    limit = _TEXT_LIMITS.get(kind, 1024)
    if len(value) > limit:
        raise ConfigError(f"{key} is {len(value)} characters long; at most {limit} are allowed.")
    if kind == "name" and (not value.strip() or value in (".", "..") or "/" in value or "\\" in value):
        raise ConfigError(f"{key} = {_show(value)} cannot name a run directory: use a non-empty name "
                          "without '/' or '\\' (and not '.' or '..').")
    if kind == "key" and not value:
        raise ConfigError(f"{key} must not be empty.")
    if kind == "factory" and value and not _FACTORY_RE.fullmatch(value):
        raise ConfigError(f"{key} must look like 'package.module:function', got {_show(value)}.")


def _check_scalar(key: str, value: Any, rule: Rule | None) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        bounds = f" {rule.describe()}" if rule and rule.describe() else ""
        raise ConfigError(f"{key} must be a finite number{bounds}, got {value}.")
    if isinstance(value, (int, float)):
        if rule is not None and rule.bounds_problem(value):
            raise ConfigError(f"{key} must be {rule.describe()}, got {_show(value, 40)}.")
        return
    if isinstance(value, str):
        check_text(key, value, rule.text if rule else "word")
        choices = rule.resolved_choices() if rule else None
        if choices is not None and value not in choices:
            raise unknown_choice(rule.label or key, value, choices, aliases=rule.aliases)


def check_value(key: str, value: Any, tp: type, rule: Rule | None = None) -> Any:
    """Coerce ``value`` to ``tp`` (int, float, str, bool) and check it against ``rule``; return it.

    For option tables outside the run config (e.g. a model preset's overrides) that want the same
    types, bounds and messages as config fields.
    """
    value = _coerce(value, tp, key)
    _check_scalar(key, value, rule)
    return value


def _check_override_value(key: str, value: Any, depth: int = 0) -> None:
    if depth > 16:
        raise ConfigError(f"{key} is nested more than 16 levels deep.")
    if isinstance(value, dict):
        for k, v in value.items():
            check_text(f"{key} key", k)
            _check_override_value(f"{key}.{k}", v, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_override_value(f"{key}[{i}]", v, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}.")
    elif isinstance(value, str):
        check_text(key, value, kind="text")


def check_overrides(key: str, overrides: dict[str, Any]) -> None:
    """Keys are keyword-argument names; values finite numbers, UTF-8 text, lists and tables of them."""
    for k, v in overrides.items():
        if not (isinstance(k, str) and k.isidentifier()):
            raise ConfigError(f"{key}: {_show(k)} is not a valid option name (a Python identifier such "
                              "as n_layer).")
        _check_override_value(f"{key}.{k}", v)


def check_section(obj: Any, prefix: str = "") -> None:
    """Check every field of a config dataclass (recursively) against its type, text rules and ``Rule``."""
    for f in dataclasses.fields(obj):
        value, key, rule = getattr(obj, f.name), f"{prefix}{f.name}", rule_of(f)
        if dataclasses.is_dataclass(value):
            check_section(value, f"{key}.")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                _check_scalar(f"{key}[{i}]", item, rule)
        elif isinstance(value, dict):
            check_overrides(key, value)
        else:
            _check_scalar(key, value, rule)


# train.loss_chunks = "auto": chunks of at most this many bytes of fp32 logits (shardwise.loss; the
# planner counts the same).
AUTO_CHUNK_BYTES = 64 * 2**20
# train.loss_chunks = "auto" chunks a micro-batch only when its whole fp32 logits would exceed this.
# Chunking is a memory measure that costs time: on an H200 (benchmarks/gpu.sh, docs/performance.md)
# GPT-2 124M at 8 x 1024 tokens ran 52.9 ms a step chunked and 31.0 ms with the logits whole (the
# chunks run eagerly, each its own launches, and recompute their logits in backward) to save 1.0 GiB
# of a 141 GiB GPU. Below 2 GiB of fp32 logits (~5 GiB with their gradient and 16-bit copy: a few
# percent of a training GPU) the memory is not worth that; above it (a 128k vocabulary at 4k+
# tokens per micro-batch) the logits become the step's largest tensor and the chunks pay.
AUTO_DENSE_LOGITS_BYTES = 2 * 2**30


def auto_chunks_logits(tokens: int, vocab: int) -> bool:
    """Whether ``train.loss_chunks = "auto"`` chunks a micro-batch of ``tokens`` tokens (on this rank)
    at a ``vocab`` wide head: its fp32 logits exceed ``AUTO_DENSE_LOGITS_BYTES``. The runtime's head
    (shardwise.loss) and the planner (plan/cp.py) both ask this."""
    return 4 * tokens * vocab > AUTO_DENSE_LOGITS_BYTES


def parse_loss_chunks(value: Any) -> int | None:
    """``train.loss_chunks`` as a number: None for 'auto', 0 for off, N > 0 chunks."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return None
        if text in ("off", "none", "false"):
            return 0
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**20:
        raise ConfigError(f"train.loss_chunks must be 'auto', 0 (off) or a number of chunks N >= 1, got {value!r}.")
    return value


def validate(cfg: RunConfig) -> None:
    """Check values that do not need to know the world size; never modifies ``cfg``.

    Every field against its declared ``Rule`` first (types, finite numbers and their bounds,
    choices, text), then what relates fields to each other. What needs the world size (degrees,
    the strategy 'auto' stands for, pipeline micro-batches) is resolved by
    ``shardwise.core.layout.resolve_layout``, which returns a new object.
    """
    check_section(cfg)
    t, p = cfg.train, cfg.parallel
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr:g}) must not exceed train.lr ({t.lr:g}): the schedule "
                          "decays from lr down to min_lr.")
    check_schedule(t, cfg.schedule)
    if p.wrap not in ("block", "model") and not (str(p.wrap).isdigit() and 1 <= int(p.wrap) <= 10**6):
        raise ConfigError(f"parallel.wrap must be 'block', 'model' or a number of blocks, got {p.wrap!r}.")
    parse_loss_chunks(t.loss_chunks)
    canonical_strategy(p.strategy)  # raises with the list of valid names; resolve_layout picks the one
    pc = cfg.profile
    if pc.end_step < pc.start_step:
        raise ConfigError(f"profile.end_step ({pc.end_step}) must be >= profile.start_step "
                          f"({pc.start_step}): the profiled window is steps start_step..end_step.")
    if pc.enabled and pc.end_step > t.steps:
        raise ConfigError(f"profile.end_step ({pc.end_step}) is after the last step (train.steps = "
                          f"{t.steps}); profile steps inside 1..{t.steps}.")
    if len(set(cfg.log.trackers)) != len(cfg.log.trackers):
        raise ConfigError(f"log.trackers lists a tracker twice: {cfg.log.trackers}.")
    _validate_model(cfg.model, cfg.lora, cfg.name)
    if (t.objective == "dpo") != (cfg.data.kind == "preference"):
        raise ConfigError(f"train.objective = {t.objective!r} with data.kind = {cfg.data.kind!r}: preference "
                          "records (data.kind = 'preference') train with train.objective = 'dpo', and the DPO "
                          "objective needs them. Set both, or neither.")
    if cfg.lora.rank and p.sequence_parallel:
        raise ConfigError("LoRA adapters do not run with parallel.sequence_parallel: the adapters' matmuls would "
                          "need their own sequence-parallel layouts. Unset sequence_parallel (tensor parallel "
                          "alone works with LoRA).")


# Recipes that fine-tune a pretrained folder: without model.pretrained they would silently train
# a randomly initialised model from scratch, so they refuse to start instead.
PRETRAINED_RECIPES = ("hf-finetune", "hf-sft", "hf-dpo")


def _validate_model(mc: ModelConfig, lc: LoraConfig, recipe: str = "") -> None:
    # Each value is checked against its field's rule already; these relate fields to each other.
    if recipe in PRETRAINED_RECIPES and not mc.pretrained:
        raise ConfigError(
            f"the {recipe} recipe fine-tunes a pretrained model, but model.pretrained is not set: add "
            "--set model.pretrained=path/to/model-folder (a local Hugging Face folder with config.json and "
            "safetensors weights, or a LoRA adapter folder on one; its tokenizer is used for data.path). To train "
            "a Hugging Face architecture from scratch, use hf-shakespeare or your own recipe with model.hf_config.")
    if mc.pretrained and mc.kind != "hf":
        raise ConfigError(f"model.pretrained = {mc.pretrained!r} loads a Hugging Face folder, which needs "
                          f"model.kind = 'hf' (it is {mc.kind!r}).")
    if lc.rank and not (mc.kind == "hf" and mc.pretrained):
        raise ConfigError(
            "lora.rank > 0 trains adapters on a frozen pretrained model: set model.kind = 'hf' and "
            "model.pretrained = 'path/to/hf-folder' (or set lora.rank = 0 to train every weight).")
