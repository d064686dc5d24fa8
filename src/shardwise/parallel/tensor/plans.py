"""Tensor-parallel plans, one per model family, written as data (torchtitan ``apply_tp`` style).

A plan maps a module path (relative to the model, or to one transformer block) to a
``ParallelStyle``. Read a block plan top to bottom and you have the whole sharding of a layer:

* attention: Q/K/V column-wise (each rank computes ``heads / tp`` heads end to end), output row-wise
  (one all-reduce, or a reduce-scatter under sequence parallel);
* MLP: up-projection column-wise, down-projection row-wise (the same single collective);
* embeddings row-wise over the vocabulary (each rank looks up the ids it owns, then one reduction),
  with the lookup on the local rows so the table's gradient stays this rank's rows too
  (``parallel/tensor/embedding.py``);
* the output head column-wise over the vocabulary with ``use_local_output=False``, so the logits
  stay a vocab-sharded DTensor and ``loss_parallel()`` computes the cross-entropy without ever
  gathering the full ``(tokens, vocab)`` logits;
* with sequence parallel the norms (and dropout) run on a sequence shard ``Shard(1)``: activations
  between the matmuls are ``tp`` times smaller, and each all-reduce becomes a reduce-scatter plus
  an all-gather (same bytes on the wire).

Models use ``view(..., -1, head_dim)``, so a rank that holds fewer heads needs no code change.

LoRA (peft) wraps a planned linear layer: ``with_lora`` moves its style onto the wrapped
``base_layer`` and shards the adapters to match (see there), so the plans themselves stay the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from shardwise.parallel.blocks import submodule
from shardwise.parallel.tensor.embedding import VocabParallelEmbedding
from shardwise.parallel.tensor.gpt2 import Conv1DColwise, Conv1DRowwise


@dataclass
class TPPlan:
    """The TP plan of one model: top-level styles, per-block styles, and where the blocks live."""

    top: dict[str, ParallelStyle]
    block: dict[str, ParallelStyle]
    blocks_path: str  # dotted path of the container holding the transformer blocks
    # Styles that replace ``block``'s for a block whose ``mlp`` is a mixture-of-experts layer.
    moe_block: dict[str, ParallelStyle] = field(default_factory=dict)


def gpt_plan(sequence_parallel: bool) -> TPPlan:
    """Return the TP plan for the built-in GPT (``shardwise.models.gpt``)."""
    # Between blocks the residual stream is a sequence shard under SP, replicated otherwise.
    resid = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {
        # Vocabulary-sharded lookup; the partial rows are reduced (or reduce-scattered along the
        # sequence under SP) into the residual stream.
        "tok_emb": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=resid),
        # Positions are looked up as (T, C) (plain rows) or (B, T, C) (packed/padded rows with
        # position_ids): the sequence dim is -2 in both, so under SP each rank gets exactly the
        # positions of its own sequence shard and the (broadcasted) add lines up.
        "pos_emb": VocabParallelEmbedding(input_layouts=Replicate(),
                                   output_layouts=Shard(-2) if sequence_parallel else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=resid, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=resid),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=resid),
    }
    if sequence_parallel:
        top["ln_f"] = SequenceParallel()
        block.update({
            "ln_1": SequenceParallel(),
            "ln_2": SequenceParallel(),
            # The norms hand over a sequence shard; attention and MLP need the whole sequence.
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return TPPlan(top=top, block=block, blocks_path="blocks",
                  moe_block=moe_block_styles(sequence_parallel, local_output=True))


def llama_plan(sequence_parallel: bool) -> TPPlan:
    """Return the TP plan for Llama-family Hugging Face models wrapped as ``HFCausalLM`` (``.hf``)."""
    resid = Shard(1) if sequence_parallel else Replicate()
    # Under SP the residual stream stays a DTensor (use_local_output=False): HF code reads the
    # sequence length from ``hidden_states.shape`` (rotary positions, causal mask, reshapes), and a
    # DTensor reports the global shape where a local shard would report T / tp.
    local = not sequence_parallel
    top: dict[str, ParallelStyle] = {
        "hf.model.embed_tokens": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=resid,
                                                 use_local_output=local),
        "hf.lm_head": ColwiseParallel(input_layouts=resid, output_layouts=Shard(-1),
                                      use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),  # GQA: needs tp | n_kv_heads (checked up front)
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=resid, use_local_output=local),
        # Qwen3's per-head q/k norms see (B, T, heads / tp, head_dim); OLMoE's whole-width ones see
        # (B, T, width / tp). Both are dim 2 of the column-parallel output: the norm runs on that
        # shard with a replicated weight, whose gradient DTensor sums over the TP ranks (each
        # rank's heads contribute to the one shared weight). A plain weight would keep only this
        # rank's share, and OLMoE's mean over the width needs the other ranks' columns.
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=resid, use_local_output=local),
    }
    if sequence_parallel:
        top["hf.model.norm"] = SequenceParallel()
        block.update({
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            # HF attention takes hidden_states plus keyword arguments (position embeddings, mask):
            # only the hidden states are re-laid-out; the rotary cos/sin are already replicated.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return TPPlan(top=top, block=block, blocks_path="hf.model.layers",
                  moe_block=moe_block_styles(sequence_parallel, local_output=local))


def gpt2_plan(sequence_parallel: bool) -> TPPlan:
    """Return the TP plan for Hugging Face GPT-2 wrapped as ``HFCausalLM`` (``.hf``).

    Its projections are ``Conv1D`` (weight ``(in, out)``), hence the Conv1D-aware styles, and its
    fused ``c_attn`` is first split into ``c_attn.q/k/v`` (``parallel/tensor/gpt2.py``). The input
    embedding is usually tied to ``lm_head``: both split the vocabulary rows (``Shard(0)`` of the
    one ``(vocab, hidden)`` weight), so the tie survives. Under SP the learned positions are looked
    up as ``(1, T, hidden)`` and reduce-scattered along the sequence like the token embeddings, so
    the two sequence shards add up; the residual stream stays a DTensor as in the Llama plan.
    """
    resid = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    top: dict[str, ParallelStyle] = {
        "hf.transformer.wte": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=resid,
                                              use_local_output=local),
        "hf.transformer.wpe": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=resid,
                                              use_local_output=local),
        "hf.lm_head": ColwiseParallel(input_layouts=resid, output_layouts=Shard(-1), use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "attn.c_attn.q": Conv1DColwise(),
        "attn.c_attn.k": Conv1DColwise(),
        "attn.c_attn.v": Conv1DColwise(),
        "attn.c_proj": Conv1DRowwise(output_layouts=resid, use_local_output=local),
        "mlp.c_fc": Conv1DColwise(),
        "mlp.c_proj": Conv1DRowwise(output_layouts=resid, use_local_output=local),
    }
    if sequence_parallel:
        top["hf.transformer.ln_f"] = SequenceParallel()
        block.update({
            "ln_1": SequenceParallel(),
            "ln_2": SequenceParallel(),
            # GPT-2 passes hidden_states to its attention and MLP positionally.
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return TPPlan(top=top, block=block, blocks_path="hf.transformer.h")


def moe_block_styles(sequence_parallel: bool, local_output: bool) -> dict[str, ParallelStyle]:
    """What replaces the plan's ``mlp`` entries in a block whose ``mlp`` is a mixture-of-experts layer.

    Without SP nothing: the MoE layer receives the replicated hidden states as plain tensors and
    its router and experts run whole on every TP rank (the dense entries ``mlp.fc`` ... do not
    exist there and are skipped). Under SP the block hands over a sequence shard: the layer gets
    the whole sequence, as plain tensors (one all-gather, as a dense MLP's input does), and its
    replicated output is cut back to this rank's sequence shard (a local slice) for the residual
    stream. Every TP rank then routes the same tokens and computes the same aux loss, so the
    experts' and router's gradients are identical on the TP ranks and need no reduction of their
    own (backward all-gathers the output gradient and slices the input gradient). ``local_output``:
    the plan keeps the residual stream as local shards (the built-in GPT) or as DTensors (HF).
    """
    if not sequence_parallel:
        return {}
    return {"mlp": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=local_output)}


# ------------------------------------------------------------------ what each plan splits
# The sizes tensor parallel must divide, per layout (the layout's one rule: ``layout.tp_indivisible``).
def gpt_sizes(model: nn.Module) -> dict[str, int]:
    c = model.config  # type: ignore[union-attr]
    return {"n_head": c.n_head, "n_embd": c.n_embd, "mlp hidden (4 x n_embd)": 4 * c.n_embd}


def gpt2_sizes(model: nn.Module) -> dict[str, int]:
    c = model.hf.config  # type: ignore[union-attr]
    return {"n_head": c.n_head, "n_embd": c.n_embd, "n_inner": c.n_inner or 4 * c.n_embd}


def llama_sizes(model: nn.Module) -> dict[str, int]:
    c = model.hf.config  # type: ignore[union-attr]
    sizes = {"num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
             "hidden_size": c.hidden_size}
    # An MoE block's experts stay whole under TP: only dense MLPs split their width.
    if any(submodule(block, "mlp.gate_proj") is not None for block in model.hf.model.layers):  # type: ignore[union-attr]
        sizes["intermediate_size"] = c.intermediate_size
    return sizes


def with_lora(plan: dict[str, ParallelStyle], root: nn.Module) -> dict[str, ParallelStyle]:
    """Return ``plan`` for ``root`` with every LoRA-wrapped layer's style moved onto its base layer.

    A peft LoRA layer computes ``base(x) + B(A(x)) * scale``; the adapters must produce the same
    layout as the base so the sum lines up, with one extra collective at most, on the rank-r side:

    * column-wise base (output split over tp): ``A`` stays whole (replicated, r x in) and ``B`` is
      column-wise too, so each rank computes the slice of ``B A x`` matching its slice of ``base(x)``;
    * row-wise base (input split over tp): ``A`` is row-wise with a replicated (all-reduced) rank-r
      output, and ``B`` stays whole, adding the full ``B A x`` to the reduced base output.

    A planned path inside a wrapped layer (GPT-2's ``attn.c_attn.q`` when LoRA wraps ``c_attn``,
    whose base layer and ``B`` were split into q/k/v by ``tensor.gpt2.split_qkv``) names a part of the
    base layer: its style goes to ``base_layer.q`` and ``B``'s own ``q`` part is column-wise too.
    """
    out: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        try:
            layer = root.get_submodule(path)
        except AttributeError:
            out.update(_inside_lora(path, style, root))
            continue
        base = getattr(layer, "base_layer", None)
        if base is None or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            out[path] = style
            continue
        out[f"{path}.base_layer"] = style
        for adapter in layer.lora_A:
            if isinstance(style, ColwiseParallel):
                out[f"{path}.lora_B.{adapter}"] = ColwiseParallel()
            else:
                out[f"{path}.lora_A.{adapter}"] = RowwiseParallel(output_layouts=Replicate())
    return out


def _inside_lora(path: str, style: ParallelStyle, root: nn.Module) -> dict[str, ParallelStyle]:
    """``{path: style}`` for a ``path`` that no module has, moved into the LoRA layer on its way
    (``X.c_attn.q`` -> ``X.c_attn.base_layer.q`` plus ``X.c_attn.lora_B.<adapter>.q``) when the base
    layer and every ``B`` hold that part; unchanged (and skipped by the caller) otherwise."""
    head, _, rest = path.rpartition(".")
    try:
        layer = root.get_submodule(head) if head else root
    except AttributeError:
        return {path: style}
    base = getattr(layer, "base_layer", None)
    adapters = getattr(layer, "lora_B", None)
    if base is None or adapters is None or not hasattr(base, rest) or not isinstance(style, ColwiseParallel):
        return {path: style}
    if not all(hasattr(b, rest) for b in adapters.values()):
        return {path: style}
    out: dict[str, ParallelStyle] = {f"{head}.base_layer.{rest}": style}
    # A stays whole on every rank; each B part's output columns match its base part's.
    out.update({f"{head}.lora_B.{adapter}.{rest}": ColwiseParallel() for adapter in adapters})
    return out
