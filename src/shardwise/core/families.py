"""The one list of model families and what shardwise can do with each (torch-free).

A family is ``ModelSpec.family`` / ``Workload.family``: "gpt" is shardwise's built-in GPT, the
others are Hugging Face ``model_type`` values. Everything that asks "can this model be
tensor-parallelised / cut into pipeline stages / built from a Hugging Face config?" reads this
table: the strategy table (``shardwise.core.strategies``), the TP plans, the block finder, the Hugging
Face config reader and the planner's spec reader. Adding a family is one row here (plus its TP
plan in ``parallel/tensor/plans.py`` when ``tp_plan`` is set).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHUNKED_HEAD_FAMILIES", "CP_FAMILIES", "DATA_KINDS", "FAMILIES", "HF_FAMILIES", "LLAMA_LIKE",
           "MODEL_KINDS", "MOE_FAMILIES", "PACK_MODES", "PP_FAMILIES", "RECORD_KINDS", "TP_FAMILIES", "Family",
           "no_stage_split", "no_tp_plan", "packs"]

# What ``model.kind`` and ``data.kind`` may be (config validation reads them; ``shardwise.workloads``
# builds each).
MODEL_KINDS = ("gpt", "cnn", "hf", "custom")
DATA_KINDS = ("shakespeare", "cifar10", "text", "tokens", "chat", "instruct", "preference", "custom")
# Data kinds whose examples are separate records with -100 labels: trained with a token-mean loss.
RECORD_KINDS = ("chat", "instruct")
# data.pack: "auto" packs records (chat/instruct: packing is what fine-tuning wants) but not text (a
# text run's numbers would change under a new default); "true"/"false" force it.
PACK_MODES = ("auto", "true", "false")


def packs(kind: str, pack: str | bool) -> bool:
    """Whether data of ``kind`` with ``data.pack = pack`` is packed: the one owner of that rule."""
    if isinstance(pack, bool):  # DataConfig(pack=True) built in Python
        return pack
    return pack == "true" or (pack == "auto" and kind in RECORD_KINDS)


@dataclass(frozen=True)
class Family:
    """One model family's capabilities.

    ``hf``: built from a Hugging Face ``config.json`` (``model.kind = 'hf'``). ``llama_like``: its
    layers follow the Llama layout (q/k/v/o_proj, gate/up/down_proj) and share one TP plan.
    ``tp_plan``: has a tensor-parallel plan. ``pp_split``: the pipeline can cut it into stages.
    ``moe``: has mixture-of-experts layers (expert parallel applies). ``cp``: context parallel's
    all-to-all attention knows its attention modules (``parallel/context/cp.py``). ``plain_head``: the
    last hidden states go straight into a bias-free ``lm_head`` whose output is the logits (no
    soft-capping or scaling), so the chunked loss (``shardwise.loss``) can replace it.
    """

    name: str
    hf: bool = True
    llama_like: bool = False
    tp_plan: bool = False
    pp_split: bool = False
    moe: bool = False
    cp: bool = False
    plain_head: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt", hf=False, tp_plan=True, pp_split=True, cp=True, plain_head=True),
    Family("llama", llama_like=True, tp_plan=True, pp_split=True, cp=True, plain_head=True),
    Family("mistral", llama_like=True, tp_plan=True, pp_split=True, cp=True, plain_head=True),
    Family("qwen2", llama_like=True, tp_plan=True, pp_split=True, cp=True, plain_head=True),
    Family("qwen3", llama_like=True, tp_plan=True, pp_split=True, cp=True, plain_head=True),
    # GPT-2: fused Conv1D q/k/v, split in three from outside under TP (parallel/tensor/gpt2.py; LoRA
    # adapters on it too); its stage split (parallel/pipeline/gpt2.py) keeps the tied wte/lm_head as one
    # copy per stage (pipeline/ties.py).
    Family("gpt2", tp_plan=True, pp_split=True),
    # Mixture-of-experts families as transformers >= 5 builds them: fused 3-D experts
    # (``mlp.experts.gate_up_proj`` / ``down_proj``) behind a top-k router (``mlp.gate``); see
    # ``models/hf_moe.py``. Their attention (and any dense MLP) takes the Llama TP plan; the MoE
    # blocks' routers and experts stay whole on every TP rank (``parallel/tensor/tp.py``). Their stages are
    # the Llama family's (``parallel/pipeline/hf.py``), carrying the routers' all-layer sums for
    # transformers' aux loss (``parallel/pipeline/hf_moe.py``). Context parallel runs on Mixtral and
    # Qwen3-MoE (their attention is Llama's; the routers' counts are summed over the data dimension,
    # cp ranks included: tests/test_cp_moe.py); Qwen2-MoE and OLMoE are not tested with it yet.
    Family("mixtral", moe=True, tp_plan=True, pp_split=True, cp=True),
    Family("qwen2_moe", moe=True, tp_plan=True, pp_split=True),
    Family("qwen3_moe", moe=True, tp_plan=True, pp_split=True, cp=True),
    Family("olmoe", moe=True, tp_plan=True, pp_split=True),
)}

LLAMA_LIKE: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.llama_like)
TP_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.tp_plan)
PP_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.pp_split)
HF_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.hf)
MOE_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.moe)
CP_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.cp)
CHUNKED_HEAD_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.plain_head)


def no_tp_plan(what: str) -> str:
    """Why tensor parallel cannot run ``what`` (a model described in words): the one wording."""
    return (f"tensor parallel has plans for the built-in GPT and the Hugging Face families "
            f"{', '.join(f for f in TP_FAMILIES if f != 'gpt')}; {what} has none")


def no_stage_split(what: str) -> str:
    """Why pipeline parallel cannot cut ``what`` (a model described in words) into stages: the one wording."""
    return (f"pipeline parallel cuts the built-in GPT and the Hugging Face families "
            f"{', '.join(f for f in PP_FAMILIES if f != 'gpt')} into stages; {what} has no stage split")
