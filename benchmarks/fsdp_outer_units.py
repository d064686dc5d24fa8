"""Embeddings and final norm + head as FSDP units of their own (issue 24): before vs after.

For the lab GPT preset and a tiny Llama under ``fsdp`` on 2 and 4 gloo ranks (CPU), through the
Session API (the runtime's own ``apply_fsdp``), one AdamW step each way:

* the memory ledger's bytes per rank (parameters, gradients, optimizer state): must not change,
  since FSDP2 shards each parameter on its own whatever the unit;
* the FSDP units and the largest one's unsharded parameter count: what one all-gather
  materialises at a time (the planner's transient term), next to the planner's own figure
  (``ModelSpec.largest_unit_params``);
* the loss after the step: identical (units change when parameters are gathered, not the math).

    python benchmarks/fsdp_outer_units.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TINY_LLAMA = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, tie_word_embeddings=False)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt-lab":
        from shardwise.models.gpt import GPT, GPT_PRESETS

        return GPT(GPT_PRESETS["lab"])
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.models.hf import HFCausalLM

    return HFCausalLM(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, attn_implementation="sdpa")))


def _units(model: torch.nn.Module) -> list[int]:
    """Unsharded parameter count of every FSDP unit (root included), in module order."""
    from torch.distributed.fsdp import FSDPModule

    seen, sizes = set(), []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        sizes.append(sum(fp._orig_size.numel() for fp in group.fsdp_params))
    return sizes


def measure(rank: int, world_size: int, separate: bool) -> dict:
    from shardwise.parallel.blocks import OuterModules
    from shardwise.parallel.data import fsdp
    from shardwise.runtime import ledger
    from shardwise.runtime.session import Session

    if not separate:  # the runtime before: embeddings and head left to the root unit
        fsdp.outer_modules = lambda model: OuterModules()
    out = {}
    for name in ("gpt-lab", "tiny-llama"):
        session = Session(strategy="fsdp", seed=0, precision="fp32")
        model = _model(name)
        vocab = 65 if name == "gpt-lab" else TINY_LLAMA["vocab_size"]
        model, opt = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        idx = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            out_ = model(idx)
            logits = out_ if isinstance(out_, torch.Tensor) else out_.logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
            session.backward(loss)
            session.step(opt)
        entry = ledger.rank_ledger(session, model, opt)
        out[name] = {"param_bytes": entry["param_bytes"], "grad_bytes": entry["grad_bytes"],
                     "optim_bytes": entry["optim_bytes"], "units": _units(model), "loss": float(loss.detach())}
        session.close()
    return out


def planner_unit(name: str) -> int:
    from shardwise.plan.presets import model_preset
    from shardwise.plan.spec import from_hf_config_dict

    spec = model_preset(name) if name == "gpt-lab" else from_hf_config_dict({**TINY_LLAMA, "model_type": "llama"})
    return spec.largest_unit_params()


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shardwise.testing import run_distributed

    for world in (2, 4):
        before = run_distributed(measure, world, timeout_s=600, separate=False)
        after = run_distributed(measure, world, timeout_s=600, separate=True)
        for name in ("gpt-lab", "tiny-llama"):
            print(f"{name}, fsdp on {world} ranks")
            for rank in range(world):
                b, a = before[rank][name], after[rank][name]
                same = all(b[k] == a[k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
                print(f"  rank {rank}: params/grads/optim bytes before {b['param_bytes']}/{b['grad_bytes']}/"
                      f"{b['optim_bytes']}, after {a['param_bytes']}/{a['grad_bytes']}/{a['optim_bytes']}"
                      f" ({'unchanged' if same else 'CHANGED'}); loss {b['loss']:.6f} -> {a['loss']:.6f}")
            b, a = before[0][name], after[0][name]
            print(f"  FSDP units (unsharded params, root first) before: {b['units']}, largest {max(b['units']):,}")
            print(f"  after: {a['units']}, largest {max(a['units']):,}; the planner's largest unit: "
                  f"{planner_unit(name):,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
