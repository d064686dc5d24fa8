"""Packed vs padded instruction data on the same records: padding fraction, rows, real tokens/s.

Makes a tiny Qwen2 folder with a ChatML template and N chat records of varying length (all in a
temporary folder), then trains `hf-sft` for a few steps in one process with `data.pack = true` and
`false`, and prints, per mode: rows, padding fraction, truncated/dropped records, real tokens/s
(tokens that are not padding; what MFU counts too) and the final loss.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_packing.py --records 500 --block 256 --steps 20
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardwise.core.config import load_config  # noqa: E402
from shardwise.runtime.trainer import Trainer  # noqa: E402
from tests.helpers.sft import chat_records, save_qwen2, write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=500)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sft-bench-"))
    model = save_qwen2(root / "qwen")
    data = write_jsonl(root / "chat.jsonl", chat_records(args.records, seed=0))
    rows = []
    for pack in (True, False):
        cfg = load_config("hf-sft", [
            f'model.pretrained="{model}"', f'data.path="{data}"', f'data.cache_dir="{root / "cache"}"',
            f"model.overrides.block_size={args.block}", f"data.pack={str(pack).lower()}",
            f"train.steps={args.steps}", f"train.micro_batch_size={args.micro_batch}", "train.eval_every=0",
            "train.eval_batches=1", "train.progress=false", "checkpoint.every=0", "train.log_every=5"])
        trainer = Trainer(cfg, root / f"run-{pack}")
        summary = trainer.run()
        train = trainer.workload.train_set
        notes = [n for n in trainer.workload.notes if "train (" in n]
        rows.append((("packed" if pack else "padded"), len(train), train.padding_fraction(),
                     summary.get("throughput", summary).get("tokens_per_s", float("nan")),
                     summary.get("final_train_loss", float("nan")), notes[0] if notes else ""))
        trainer.session.close()
    print(f"\n{args.records} chat records, rows of {args.block} tokens, micro-batch {args.micro_batch}, "
          f"{args.steps} steps, 1 process (CPU)")
    print(f"{'mode':<8} {'rows':>6} {'padding':>8} {'real tokens/s':>14} {'final loss':>11}")
    for mode, n, pad, tps, loss, _ in rows:
        print(f"{mode:<8} {n:>6} {pad:>8.1%} {tps:>14.0f} {loss:>11.4f}")
    print(rows[0][5])


if __name__ == "__main__":
    main()
