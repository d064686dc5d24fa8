"""One adapter per model layout: what parallelism must know of a model's code, in one place.

``core/families.py`` (torch-free) says what each model family supports; the code that does it per
family is here, one ``ModelAdapter`` per layout of model code the runtime knows:

* ``gpt``: shardwise's own GPT (``models/gpt.py``);
* ``gpt2``: Hugging Face GPT-2 (``Conv1D`` projections, the fused q/k/v ``c_attn``, learned positions);
* ``llama``: every Llama-like Hugging Face family (llama, mistral, qwen2, qwen3) and the
  mixture-of-experts ones built on the same attention (mixtral, qwen2_moe, qwen3_moe, olmoe).

Each holds its tensor-parallel plan and the sizes that plan must divide, what TP does to the model
first (GPT-2's q/k/v split), and its pipeline stage split (block count, check, prune, stage
module). ``adapter_for(model)`` picks one (``blocks.tp_plan_family`` names it from the family);
``tensor/tp.py`` and ``pipeline/pp.py`` ask nothing else. The fused q/k/v names checkpoints,
export and LoRA see are ``models/gpt2_qkv.py`` (name-based: it applies to whatever model holds the
split). A family with a new code layout: one adapter here, one row in ``core/families.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from shardwise.parallel.blocks import tp_plan_family
from shardwise.parallel.pipeline.gpt import check_gpt_pp_model, gpt_stage, n_gpt_blocks, prune_gpt_to_stages
from shardwise.parallel.pipeline.gpt2 import GPT2Stage, check_gpt2_pp_model, prune_gpt2_to_stages
from shardwise.parallel.pipeline.hf import check_hf_pp_model, hf_stage, n_layers, prune_hf_to_stages
from shardwise.parallel.tensor.gpt2 import split_qkv
from shardwise.parallel.tensor.plans import TPPlan, gpt2_plan, gpt2_sizes, gpt_plan, gpt_sizes, llama_plan, llama_sizes

__all__ = ["ADAPTERS", "ModelAdapter", "StageSplit", "adapter_for"]


@dataclass(frozen=True)
class StageSplit:
    """How the pipeline cuts one layout into stages (``pipeline/pp.py`` calls these)."""

    n_blocks: Callable[[nn.Module], int]  # blocks the stages share out
    check: Callable[[nn.Module], None]  # raises ConfigError when this model cannot be cut
    prune: Callable[[nn.Module, list[int], list[range]], nn.Module]  # keep only the local stages' parts
    stage: Callable[[nn.Module, int, list[range]], nn.Module]  # one stage's module over the union


@dataclass(frozen=True)
class ModelAdapter:
    """What tensor and pipeline parallelism need of one layout of model code."""

    name: str
    tp_plan: Callable[[bool], TPPlan]  # the plan, given sequence parallel on/off
    tp_sizes: Callable[[nn.Module], dict[str, int]]  # sizes the plan splits (each must divide by tp)
    stages: StageSplit
    before_tp: Callable[[nn.Module, int], None] | None = None  # a rewrite TP needs first, given tp


ADAPTERS: dict[str, ModelAdapter] = {a.name: a for a in (
    ModelAdapter("gpt", gpt_plan, gpt_sizes,
                 StageSplit(n_gpt_blocks, check_gpt_pp_model, prune_gpt_to_stages, gpt_stage)),
    ModelAdapter("gpt2", gpt2_plan, gpt2_sizes,
                 StageSplit(n_layers, check_gpt2_pp_model, prune_gpt2_to_stages, GPT2Stage),
                 before_tp=split_qkv),
    ModelAdapter("llama", llama_plan, llama_sizes,
                 StageSplit(n_layers, check_hf_pp_model, prune_hf_to_stages, hf_stage)),
)}


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The adapter of ``model``'s family, or None when parallelism has none (no TP plan, no stages)."""
    return ADAPTERS.get(tp_plan_family(model))
