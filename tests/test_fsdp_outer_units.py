"""Embeddings and final norm + head are FSDP units of their own (torchtitan's order), and the
planner's largest unit is the runtime's. Before/after figures: benchmarks/fsdp_outer_units.py."""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel.blocks import outer_modules
from shardwise.plan.presets import model_preset
from shardwise.plan.spec import from_module
from shardwise.testing import run_distributed


def _models() -> dict[str, torch.nn.Module]:
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.models.hf import build_hf_model

    with torch.device("meta"):
        return {"gpt-lab": GPT(GPT_PRESETS["lab"]), "llama-tiny": build_hf_model("llama-tiny"),
                "gpt2-tiny": build_hf_model("gpt2-tiny")}


def test_outer_modules_are_the_embeddings_and_the_head_and_the_planner_counts_them():
    pytest.importorskip("transformers")
    models = _models()
    lab = outer_modules(models["gpt-lab"])
    assert [type(m).__name__ for m in lab.before] == ["Embedding", "Embedding"]
    assert [type(m).__name__ for m in lab.after] == ["LayerNorm", "Linear"]
    llama = outer_modules(models["llama-tiny"])
    assert len(llama.before) == 1 and [type(m).__name__ for m in llama.after][-1] == "Linear"
    # GPT-2 ties its head to the token embedding: both stay in the root unit.
    assert outer_modules(models["gpt2-tiny"]).before == ()
    for name, model in models.items():
        outer = outer_modules(model)
        sizes = tuple(sum(p.numel() for m in side for p in m.parameters()) for side in (outer.before, outer.after))
        spec = from_module(model, name=name)
        if outer.before:
            assert spec.outer_unit_params == sizes, name
        else:
            assert spec.outer_unit_params == (sum(p.numel() for p in model.parameters()) - sum(
                p.numel for p in spec.params if p.unit >= 0),), name
    assert model_preset("gpt-lab").outer_unit_params == from_module(models["gpt-lab"]).outer_unit_params


def units_after_fsdp(rank: int, world_size: int) -> dict[str, list[int]]:
    from torch.distributed.fsdp import FSDPModule

    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.runtime.session import Session

    session = Session(strategy="fsdp", seed=0, precision="fp32")
    model, _ = session.prepare(GPT(GPT_PRESETS["lab"]))
    seen, sizes = set(), []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                sizes.append(sum(fp._orig_size.numel() for fp in group.fsdp_params))
    idx = torch.randint(0, 65, (2, 16))
    session.backward(model(idx).float().pow(2).mean())  # forward and backward run through the units
    session.close()
    return {"units": sizes}


def test_fsdp_shards_embeddings_and_head_as_their_own_units():
    (out,) = run_distributed(units_after_fsdp, 1, timeout_s=120)
    spec = model_preset("gpt-lab")
    blocks = [v for k, v in spec.unit_params().items() if k >= 0]
    assert out["units"] == [spec.outer_unit_params[0], *blocks, spec.outer_unit_params[1]]
    assert spec.largest_unit_params() == max(out["units"])
