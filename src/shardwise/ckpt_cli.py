"""``shardwise ckpt inspect|export``: look into a sharded checkpoint and export its weights.

``export --format safetensors`` (the default) writes one file with shardwise's own tensor names;
``--format hf`` a Hugging Face model folder (``from_pretrained`` loads it; ``--merge`` folds LoRA
adapters into their base); ``--format peft`` a LoRA checkpoint's adapter folder.

Neither needs a process group or the ranks that wrote the checkpoint: DCP shards are read in
this one process, after the manifest checksums are verified.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from shardwise.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ckpt inspect`` and ``ckpt export`` to the ``shardwise`` command line."""
    p = sub.add_parser("ckpt", help="inspect a checkpoint or export its weights",
                       description="Work with shardwise checkpoints (PyTorch DCP, sharded by rank).")
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    i = cmds.add_parser("inspect", help="step, strategy, world size, tensors and sizes",
                        description="Show what a checkpoint holds, after verifying its checksums.")
    i.add_argument("path", help="a step-N checkpoint, a checkpoints/ folder or a run directory")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of every file (faster on very large checkpoints)")
    i.set_defaults(func=cmd_inspect)

    e = cmds.add_parser("export", help="write consolidated weights: safetensors, a Hugging Face or a PEFT folder",
                        description="Gather the model's full weights from every shard. --format safetensors "
                        "(default): one file that loads into the plain single-process model with "
                        "model.load_state_dict(safetensors.torch.load_file(PATH)). --format hf: a Hugging Face "
                        "folder (config.json, sharded safetensors with the original names, "
                        "model.safetensors.index.json) for AutoModelForCausalLM.from_pretrained(DIR). "
                        "--format peft: a LoRA run's adapter folder for PeftModel.from_pretrained(base, DIR). "
                        "Folders are written aside and renamed into place when complete.")
    e.add_argument("path", help="a step-N checkpoint, a checkpoints/ folder or a run directory")
    e.add_argument("--out", required=True,
                   help="output: a .safetensors file (--format safetensors) or a new folder (hf, peft)")
    e.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                   help="what to write (default: safetensors, one file with shardwise's names)")
    e.add_argument("--adapter", action="store_true", help="same as --format peft")
    e.add_argument("--merge", action="store_true",
                   help="--format hf of a LoRA run: merge the adapters into the pretrained base (peft's "
                   "merge_and_unload; needs the base folder and the whole model in host memory)")
    e.add_argument("--base", default=None, metavar="DIR",
                   help="--format hf/peft: the pretrained folder the run started from (merge weights, tokenizer "
                   "files to copy, the adapter's base); default: the path the checkpoint records")
    e.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--format hf: largest weight file, e.g. 5GB (default), 500MB, 2GiB")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="--format hf: element type of the written weights (default: as trained)")
    e.set_defaults(func=cmd_export)


def _size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n_bytes < 1024 or unit == "TiB":
            return f"{n_bytes:.1f} {unit}" if unit != "B" else f"{int(n_bytes)} B"
        n_bytes /= 1024
    return f"{n_bytes:.1f} TiB"


def cmd_inspect(args: argparse.Namespace) -> int:
    from shardwise.runtime.checkpoint.export import inspect_checkpoint  # defers torch

    info = inspect_checkpoint(args.path, verify=not args.no_verify)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    data = info["data"] or {}
    print(f"checkpoint   {info['path']}")
    print(f"step         {info['step']}   (saved {info['created']}, torch {info['torch']})")
    print(f"saved by     strategy {info['strategy']} on {info['world_size']} rank(s)")
    print(f"fingerprint  {info['fingerprint']}   (model tensor names and shapes)")
    if data:
        print(f"data         epoch {data['epoch']}, batch {data['batch_in_epoch']} of that epoch "
              f"(global batch {data['batch_size'] * data['num_replicas']}, seed {data['seed']})")
    checked = "all checksums verified" if info["verified"] else "checksums not verified"
    print(f"size         {_size(info['total_bytes'])} in {info['files']} files ({checked})")
    for group, g in info["groups"].items():
        print(f"  {group:<10} {g['tensors']:>5} tensors  {g['elements']:>14,} elements  {_size(g['bytes'])}")
    print("model tensors:")
    width = max((len(n) for n in info["model_tensors"]), default=10)
    for name, (shape, dtype) in info["model_tensors"].items():
        numel = math.prod(shape) if shape else 1
        print(f"  {name:<{width}}  {str(tuple(shape)):<16} {dtype:<9} {numel:>12,}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardwise.runtime.checkpoint.export import export_weights  # defers torch
    from shardwise.runtime.checkpoint.hf_export import export_hf, export_peft  # defers torch

    fmt = "peft" if args.adapter else args.format
    if args.adapter and args.format not in ("safetensors", "peft"):
        raise ConfigError(f"--adapter means --format peft; it contradicts --format {args.format}.")
    if fmt != "hf" and (args.merge or args.dtype or args.max_shard_size != "5GB"):
        raise ConfigError("--merge, --dtype and --max-shard-size apply to --format hf only.")
    if fmt == "safetensors" and args.base:
        raise ConfigError("--base applies to --format hf and --format peft only.")
    if fmt == "hf":
        result: dict[str, Any] = export_hf(args.path, args.out, merge=args.merge, base=args.base,
                                           max_shard_size=args.max_shard_size, dtype=args.dtype)
        extra = f"; copied {', '.join(result['companions'])}" if result["companions"] else ""
        print(f"wrote {result['out']}: {'merged ' if result['merged'] else ''}Hugging Face model, "
              f"{result['tensors']} tensors in {result['files']} file(s), {_size(result['bytes'])} "
              f"{result['dtype']}, step {result['step']}{extra}")
        return 0
    if fmt == "peft":
        result = export_peft(args.path, args.out, base=args.base)
        print(f"wrote {result['out']}: PEFT adapter, {result['tensors']} tensors, {_size(result['bytes'])}, "
              f"step {result['step']}")
        return 0
    result = export_weights(args.path, args.out)
    print(f"wrote {result['out']}: {result['tensors']} tensors, {_size(result['bytes'])}, "
          f"step {result['step']}")
    return 0
