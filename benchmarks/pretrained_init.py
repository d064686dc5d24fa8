"""Meta-device init and pretrained loading figures (issue 9; figures, not a test).

    .venv/bin/python benchmarks/pretrained_init.py rss --preset lab --strategy fsdp --nproc 2
    .venv/bin/python benchmarks/pretrained_init.py load --hidden 1024 --layers 16 --nproc 2
    .venv/bin/python benchmarks/pretrained_init.py load --strategies fsdp --export

``rss``: host peak RSS per rank (Linux VmHWM) when building the built-in GPT preset and
applying the strategy, with ``model.init = "eager"`` (every rank builds the whole model, then
shards it) and ``"meta"`` (built on the meta device, each rank allocates and initialises only its
shards). Each init mode runs in fresh processes, so the peaks do not mix; the baseline is the RSS
after imports and the process group, before the model.

``load``: saves a random Llama of the given size with ``save_pretrained`` (sharded, 2GB files),
then times ``Session.build`` + ``prepare`` from that folder under each strategy (slowest rank,
page cache warm after the first), the parameter bytes each rank holds, its private memory growth
(RssAnon) and its peak RSS growth, which also counts the file pages safetensors maps while
reading. ``--export`` also trains one step under the first strategy, saves a checkpoint,
exports it with ``ckpt export --format hf`` and prints the largest logit difference between
``AutoModelForCausalLM.from_pretrained`` of the export and shardwise's model.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path


def _rss_mib() -> float:
    """This process's peak RSS in MiB since it started its program.

    Linux: VmHWM, which starts afresh at exec. getrusage's ru_maxrss does not: a spawned rank
    inherits its parent's peak (here the parent that saved the model), hiding the rank's own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass  # not Linux: ru_maxrss below (KiB on Linux, bytes on macOS)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _anon_mib() -> float:
    """This process's private (anonymous) resident memory now, in MiB (Linux RssAnon; 0 elsewhere).

    Unlike the peak RSS it leaves out file pages mapped by safetensors' ``safe_open`` (page cache,
    shared by every rank reading the same file, released when the file is closed).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass  # not Linux
    return 0.0


def _gpt_rank(rank: int, world_size: int, preset: str, strategy: str, init: str) -> dict:
    import torch

    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.runtime import ledger
    from shardwise.runtime.session import Session

    session = Session(strategy, seed=0)
    base = _rss_mib()
    t0 = time.perf_counter()
    model = session.build(lambda: GPT(GPT_PRESETS[preset]), init=init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = session.prepare(model, opt)
    seconds = time.perf_counter() - t0
    out = {"base": base, "peak": _rss_mib(), "s": seconds, "param_mib": ledger.param_bytes(model) / 2**20}
    session.close()
    return out


def cmd_rss(args: argparse.Namespace) -> None:
    from shardwise.testing import run_distributed

    print(f"GPT preset {args.preset!r}, strategy {args.strategy}, {args.nproc} ranks (CPU, gloo)")
    print("| init | rank | baseline RSS MiB | peak RSS MiB | growth MiB | params held MiB | build+prepare s |")
    print("|---|---|---|---|---|---|---|")
    import torch

    from shardwise.models.gpt import GPT, GPT_PRESETS

    with torch.device("meta"):
        full = sum(p.numel() * 4 for p in GPT(GPT_PRESETS[args.preset]).parameters()) / 2**20
    for init in ("eager", "meta"):
        results = run_distributed(_gpt_rank, args.nproc, timeout_s=900, preset=args.preset,
                                  strategy=args.strategy, init=init)
        for r, res in enumerate(results):
            print(f"| {init} | {r} | {res['base']:.0f} | {res['peak']:.0f} | {res['peak'] - res['base']:.0f} | "
                  f"{res['param_mib']:.1f} | {res['s']:.2f} |")
    print(f"(the whole model's fp32 parameters: {full:.1f} MiB)")


def _save_llama(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(folder), max_shard_size="2GB")
    return sum(p.numel() for p in model.parameters())


def _load_rank(rank: int, world_size: int, folder: str, strategy: str, tp: int, export_dir: str,
               vocab: int) -> dict:
    import torch

    from shardwise.core.config import ParallelConfig
    from shardwise.models.hf import build_hf_model
    from shardwise.runtime.session import Session

    session = Session(parallel=ParallelConfig(strategy=strategy, tp=tp), seed=0)
    base, anon0 = _rss_mib(), _anon_mib()
    session.barrier()
    t0 = time.perf_counter()
    model = session.build(lambda: build_hf_model(pretrained=folder, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = session.prepare(model, opt)
    session.barrier()
    seconds = time.perf_counter() - t0
    from shardwise.runtime import ledger

    out = {"s": seconds, "base": base, "peak": _rss_mib(), "anon": _anon_mib() - anon0,
           "held": ledger.param_bytes(model) / 2**20}
    if export_dir:
        x = torch.randint(0, vocab, (2, 65), generator=torch.Generator().manual_seed(0))
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        session.backward(loss)
        session.step(opt)
        with torch.no_grad():
            logits = model.eval()(x[:, :-1])
        session.save(export_dir, model, opt, step=1)
        out["logits"] = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        out["x"] = x[:, :-1]
    session.close()
    return out


def cmd_load(args: argparse.Namespace) -> None:
    import torch

    from shardwise.testing import run_distributed

    root = Path(tempfile.mkdtemp(prefix="shardwise-pretrained-bench-"))
    try:
        t0 = time.perf_counter()
        n = _save_llama(root / "llama", args.hidden, args.layers, args.vocab)
        size = sum(f.stat().st_size for f in (root / "llama").glob("*.safetensors"))
        print(f"Llama {n / 1e6:.0f}M parameters ({size / 2**30:.2f} GiB fp32 safetensors; hidden {args.hidden}, "
              f"{args.layers} layers, vocab {args.vocab}), saved in {time.perf_counter() - t0:.0f}s; "
              f"{args.nproc} ranks (CPU, gloo)")
        print("| strategy | load s (slowest rank) | parameters held MiB per rank | private memory growth MiB "
              "per rank (RssAnon) | peak RSS growth MiB per rank (incl. mapped file pages) |")
        print("|---|---|---|---|---|")
        for i, strategy in enumerate(args.strategies.split(",")):
            export_dir = str(root / "ckpt") if args.export and i == 0 else ""
            tp = args.nproc if "tp" in strategy else 1
            ranks = 1 if strategy == "single" else args.nproc
            results = run_distributed(_load_rank, ranks, timeout_s=1800, folder=str(root / "llama"),
                                      strategy=strategy, tp=tp, export_dir=export_dir, vocab=args.vocab)
            held = " / ".join(f"{r['held']:.0f}" for r in results)
            anon = " / ".join(f"{r['anon']:.0f}" for r in results)
            growth = " / ".join(f"{r['peak'] - r['base']:.0f}" for r in results)
            print(f"| {strategy} ({ranks} rank{'s' if ranks > 1 else ''}) | {max(r['s'] for r in results):.2f} | "
                  f"{held} | {anon} | {growth} |", flush=True)
            if export_dir:
                from transformers import AutoModelForCausalLM

                from shardwise.runtime.checkpoint.hf_export import export_hf

                t0 = time.perf_counter()
                written = export_hf(export_dir, root / "export")
                seconds = time.perf_counter() - t0
                hf = AutoModelForCausalLM.from_pretrained(str(root / "export")).eval()
                with torch.no_grad():
                    theirs = hf(results[0]["x"]).logits
                diff = (theirs - results[0]["logits"]).abs().max().item()
                export_line = (f"export round trip ({strategy}, 1 step): ckpt export --format hf wrote "
                               f"{written['files']} file(s) in {seconds:.1f}s; max |logits(from_pretrained) - "
                               f"logits(shardwise)| = {diff:.3g}")
        if args.export:
            print(export_line)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rss", help="peak host RSS, eager vs meta init")
    r.add_argument("--preset", default="lab")
    r.add_argument("--strategy", default="fsdp")
    r.add_argument("--nproc", type=int, default=2)
    r.set_defaults(func=cmd_rss)
    load = sub.add_parser("load", help="pretrained load time per strategy (+ export round trip)")
    load.add_argument("--hidden", type=int, default=1024)
    load.add_argument("--layers", type=int, default=16)
    load.add_argument("--vocab", type=int, default=32000)
    load.add_argument("--nproc", type=int, default=2)
    load.add_argument("--strategies", default="fsdp,single,ddp,zero2,tp,fsdp+tp")
    load.add_argument("--export", action="store_true")
    load.set_defaults(func=cmd_load)
    args = p.parse_args()
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
