"""A played pipeline rank's neighbours, answered on this rank: what torch's schedule reads from
point-to-point messages before its first step, which torch's ``fake`` process group never delivers.

Before a schedule's first step (torch 2.13, ``schedules._PipelineSchedule._initialize_pp_stages``):

* **the warm-up vote** (``_warmup_p2p``): each stage votes static (1) or dynamic (0) metadata,
  the product travels to the last stage and back, and every stage reads it with ``.item()``. A
  fake tensor has no value to read. The vote is decided by what each stage was built with: shardwise
  builds every ``PipelineStage`` of every rank the same way, without ``input_args``/``output_args``,
  so every stage votes dynamic and the product is 0 on a real cluster. Here each stage is set to
  the mode its own vote makes (dynamic) without a message: the value the real run reads.
* **the metadata exchange** (dynamic mode): stage s receives the shape, stride and dtype of stage
  s-1's output (``_recv_meta``), runs its forward on an empty tensor of that shape to learn its own
  output, and later receives its output gradient's metadata from stage s+1. The played rank answers
  both itself: the forward message is the residual stream entering a stage (``boundary_meta``:
  micro-batch rows, the sequence, the hidden size, the run's compute dtype); the backward message is
  the gradient of this stage's output, which for a plain tensor has the output's shape and dtype
  (torch's own ``_derive_grad_metas``, what the next stage derives from its input).

Everything after that (the schedule's sends, receives and the stages' real forwards and backwards)
is the runtime's own code. The forward answer is checked where this rank can check it: a stage
that is not the last sends its output to the next, so its inferred output must be the boundary
this module answered; a difference ends the rank with the two metadata (never a number).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import _utils as pp_utils

from shardwise.models.masking import split_inputs
from shardwise.parallel.precision import compute_dtype, storage_dtype

# The mode a stage built without input_args/output_args votes for (torch's InferenceMode).
_DYNAMIC = pp_utils.InferenceMode.DYNAMIC


def hidden_size(model: Any) -> int:
    """The residual stream's width of a pipeline union: the built-in GPT's ``n_embd`` or a
    Hugging Face config's ``hidden_size``."""
    config = getattr(getattr(model, "hf", None), "config", None) or getattr(model, "config", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not width:
        raise ValueError(f"cannot read the hidden size of {type(model).__name__} for its pipeline boundary")
    return int(width)


def boundary_dtype(precision: str, dp_kind: str) -> torch.dtype:
    """The dtype of the activations a stage sends: FSDP2's mixed precision computes every unit,
    embeddings included, in the compute dtype; under autocast the embedding's output and the
    residual additions stay in the parameters' dtype (float32); bf16-true stores bfloat16."""
    mixed = compute_dtype(precision)
    if mixed is not None and dp_kind == "fsdp":
        return mixed
    return storage_dtype(precision) or torch.float32


def boundary_meta(rows: int, seq: int, hidden: int, dtype: torch.dtype, requires_grad: bool,
                  sp_mesh: Any = None) -> Any:
    """torch's metadata of the hidden states entering a stage: ``(rows, seq, hidden)``, contiguous.
    Under sequence parallel a stage sends its sequence shard (``parallel.pipeline.hf.HFStage``):
    torch's ``Shard(1)`` split of ``seq`` over the tp group, this rank's piece."""
    if sp_mesh is not None:
        size, index = sp_mesh.size(), sp_mesh.get_local_rank()
        chunk = -(-seq // size)
        seq = max(0, min(chunk, seq - index * chunk))
    shape = torch.Size((rows, seq, hidden))
    return pp_utils._TensorMeta(shape=shape, stride=torch.empty(shape, device="meta").stride(), dtype=dtype,
                                requires_grad=requires_grad)


class LocalNeighbours:
    """Answers a pipeline's pre-step messages on this rank (module docstring)."""

    def __init__(self, pipeline: Any, hidden: int, dtype: torch.dtype) -> None:
        self.pipeline, self.hidden, self.dtype = pipeline, hidden, dtype
        self.batch_shape: tuple[int, ...] | None = None
        self.has_backward = True
        schedules = {id(s): s for s in (pipeline.schedule, pipeline._eval_schedule)}.values()
        for schedule in schedules:
            schedule._warmup_p2p = self._vote  # instance attributes: torch's classes are untouched
        for stage in pipeline.stages:
            stage._recv_meta = functools.partial(self._recv_meta, stage)
            stage._prepare_forward_infra = self._checked(stage, stage._prepare_forward_infra)
        pipeline.run = self._seeing_batch(pipeline.run)

    def _seeing_batch(self, run: Callable) -> Callable:
        """``Pipeline.run`` that first notes the batch's shape (rows and sequence of the boundary)."""
        @functools.wraps(run)
        def seeing(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self.batch_shape = tuple(split_inputs(inputs)[0].shape)
            return run(inputs, *args, **kwargs)

        return seeing

    def _vote(self, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        """The warm-up vote's outcome without its messages: every stage's own vote (dynamic)."""
        self.has_backward = has_backward
        for stage in stages:
            if not pp_utils.InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"stage {stage.stage_index} was built with static metadata; the rehearsal "
                                   "answers only the dynamic exchange (rehearse/fake_p2p.py)")
            stage._inference_mode = _DYNAMIC

    def boundary(self, stage: Any) -> Any:
        """The metadata of what stage ``stage.stage_index - 1`` sends to ``stage``."""
        if self.batch_shape is None:
            raise RuntimeError("the pipeline ran before its batch's shape was seen")
        rows = self.batch_shape[0] // self.pipeline.n_microbatches
        module = getattr(stage.submod, "module", stage.submod)  # DDP wraps; FSDP2 is in place
        hidden = boundary_meta(rows, self.batch_shape[1], self.hidden, self.dtype, self.has_backward,
                               getattr(module, "_sp_mesh", None))
        routing = getattr(module, "moe_routing", None)
        if routing is None:
            return (hidden,)
        # A Hugging Face MoE stage also sends its routers' running sums, fp32 (2, experts)
        # (parallel/pipeline/hf_moe.py).
        shape = torch.Size((2, routing.recorder.n_experts))
        return hidden, pp_utils._TensorMeta(shape=shape, stride=(shape[1], 1), dtype=torch.float32,
                                            requires_grad=self.has_backward)

    def _recv_meta(self, stage: Any, src_stage: int) -> Any:
        if src_stage < stage.stage_index:  # forward: the previous stage's output
            return pp_utils._StageForwardMeta(forward_metas=self.boundary(stage))
        # backward: the next stage's input gradient, i.e. this stage's output's gradient
        return pp_utils._StageBackwardMeta(backward_metas=pp_utils._derive_grad_metas(stage._stage_meta.outputs))

    def _checked(self, stage: Any, prepare: Callable) -> Callable:
        """``_prepare_forward_infra`` that checks a non-last stage's inferred output against the
        boundary this module answers to the next stage (the same metadata on a real cluster)."""
        @functools.wraps(prepare)
        def run(*args: Any, **kwargs: Any) -> Any:
            out = prepare(*args, **kwargs)
            if not stage.is_last:
                expected = self.boundary(stage)
                if tuple(stage._stage_meta.outputs) != expected:
                    raise RuntimeError(
                        f"stage {stage.stage_index} sends {stage._stage_meta.outputs}, but the rehearsal answers "
                        f"{expected} for a stage boundary (rehearse/fake_p2p.py): its later stages would be "
                        "played with the wrong receive buffers")
            return out

        return run

