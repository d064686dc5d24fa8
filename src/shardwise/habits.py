"""What users bring from other tools: Accelerate's and torchrun's launch flags, and the config names
of transformers' TrainingArguments, TRL and PEFT, mapped to shardwise's spelling (torch-free; below
``config`` and ``cli``, which ask it).

A flag with the same meaning here is accepted as an alias; one without is answered with the
shardwise spelling. An unknown ``--set`` key that another tool spells so is answered with its home.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardwise.errors import ConfigError

# Other tools' config names -> shardwise's key (or the flag that sets it).
OTHER_TOOLS_KEYS: dict[str, str] = {
    "learning_rate": "train.lr",
    "lr_scheduler_type": "train.lr with train.min_lr and train.warmup_steps (a cosine schedule)",
    "warmup_ratio": "train.warmup_steps",
    "max_steps": "train.steps",
    "num_train_epochs": "train.steps",
    "per_device_train_batch_size": "train.micro_batch_size",
    "train_batch_size": "train.micro_batch_size",
    "batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "max_grad_norm": "train.grad_clip",
    "clip_grad_norm": "train.grad_clip",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "--resume PATH",
    "output_dir": "--out DIR",
    "max_seq_length": "model.overrides.block_size",
    "max_length": "model.overrides.block_size",
    "seq_length": "model.overrides.block_size",
    "model_max_length": "model.overrides.block_size",
    "dataset_text_field": "data.text_field",
    "packing": "data.pack",
    "completion_only_loss": "data.train_on_prompt (false: loss on the completion only)",
    "assistant_only_loss": "data.train_on_prompt (false: loss on the assistant turns only)",
    "model_name_or_path": "model.pretrained",
    "bf16": "parallel.precision=\"bf16-mixed\"",
    "fp16": "parallel.precision=\"fp16-mixed\"",
    "mixed_precision": "parallel.precision",
    "gradient_checkpointing": "parallel.activation_checkpointing=\"full\"",
    "torch_compile": "train.compile",
    "r": "lora.rank",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets",
    "num_processes": "--nproc N",
    "report_to": "log.trackers",
}


def other_tools_hint(key: str) -> str:
    """' (learning_rate is train.lr here.)' for a key another tool spells so, else ''."""
    name = key.rsplit(".", 1)[-1]
    home = OTHER_TOOLS_KEYS.get(name)
    if home is None or home == key:
        return ""
    return f" ({name} is {home} in shardwise.)"


class _SetAlias(argparse.Action):
    """A launch flag whose value is one config setting: appended to ``--set`` (later --set wins)."""

    def __init__(self, option_strings: list[str], dest: str, key: str = "", convert: Any = None,
                 **kwargs: Any) -> None:
        self.key, self.convert = key, convert
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        value = self.convert(values) if self.convert else values
        namespace.overrides = [*getattr(namespace, "overrides", []), f"{self.key}={json.dumps(value)}"]


class _Answer(argparse.Action):
    """A flag with no meaning here: refused with the shardwise spelling."""

    def __init__(self, option_strings: list[str], dest: str, answer: str = "", **kwargs: Any) -> None:
        self.answer = answer
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise ConfigError(f"{option_string} is Accelerate's or torchrun's flag; in shardwise: {self.answer}.")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"expected a whole number, got {text!r}.") from None


def add_launch_habits(p: argparse.ArgumentParser) -> None:
    """Accelerate's and torchrun's launch flags on ``shardwise train`` (hidden from --help)."""
    hide = argparse.SUPPRESS
    # The same meaning: aliases. (--nproc_per_node/--nnodes/--node_rank/--rdzv_endpoint are the
    # train parser's own.) Accelerate's num_processes counts every machine's; on one node that is --nproc.
    keep = argparse.SUPPRESS  # the shared dests keep the train parser's own defaults
    p.add_argument("--num_processes", "--num-processes", dest="nproc", type=_int, default=keep, help=hide)
    p.add_argument("--num_machines", "--num-machines", dest="nnodes", default=keep, help=hide)
    p.add_argument("--machine_rank", "--machine-rank", dest="node_rank", type=_int, default=keep, help=hide)
    p.add_argument("--mixed_precision", "--mixed-precision", action=_SetAlias, key="parallel.precision",
                   dest="_habit_precision", default=keep, help=hide)
    p.add_argument("--gradient_accumulation_steps", "--gradient-accumulation-steps", action=_SetAlias,
                   key="train.grad_accum_steps", convert=_int, dest="_habit_accum", default=keep, help=hide)
    p.add_argument("--max_restarts", dest="max_restarts", type=_int, default=keep, help=hide)
    # No such flag here: the answer.
    answers = {
        ("--main_process_ip", "--main-process-ip", "--master_addr", "--master-addr"):
            "--rdzv-endpoint HOST:PORT (the first node's address, the same on every node)",
        ("--main_process_port", "--main-process-port", "--master_port", "--master-port"):
            "--rdzv-endpoint HOST:PORT (the port after the host)",
        ("--use_fsdp", "--use-fsdp"): "--strategy fsdp (or hsdp, fsdp+tp, ...; shardwise plan recommends one)",
        ("--use_deepspeed", "--use-deepspeed"): "--strategy zero3 / zero3-offload / zero3-nvme, or --strategy "
                                                "deepspeed with --set parallel.deepspeed_config=FILE",
        ("--multi_gpu", "--multi-gpu"): "several ranks are --nproc N (default: one per GPU)",
        ("--config_file", "--config-file"): "a shardwise TOML as the first argument (shardwise train FILE.toml)",
        ("--standalone",): "a one-node run needs no flag (--nnodes/--rdzv-endpoint for several nodes)",
    }
    for flags, answer in answers.items():
        p.add_argument(*flags, action=_Answer, answer=answer, nargs="?", dest="_habit_answer", default=keep,
                       help=hide)
