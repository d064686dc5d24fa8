"""The reference model of DPO, three ways, none of them a second unsharded copy.

* **adapters off** (LoRA runs): the reference is the policy with its LoRA adapters switched off,
  what peft's ``disable_adapter()`` does: no second copy of anything.
* **a frozen copy** (full fine-tunes): the same model built again and sharded by the same strategy
  on the same mesh (FSDP2 units, TP plans), every parameter frozen: no gradients, no optimizer
  state, and each rank holds exactly the shards it holds of the policy. Its values are copied from
  the policy's shards before the first step, so it is the starting point whatever the init.
* **precomputed** (``preference.precompute_reference``): the policy scores every pair once before
  training; the log-probs travel with the data (``PairSet.ref``) and are kept in the run directory
  (``reference_logps.npz``), so a resumed run reads them instead of scoring its trained weights.

Every score runs through ``Session.eval_loss`` (autocast, TP's ``loss_parallel``, FSDP's reshard),
in eval mode: the reference is deterministic, so precomputed and live references agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shardwise.models.names import clean_name
from shardwise.parallel.parallelize import parallelize
from shardwise.preference import pipeline as pipe
from shardwise.preference.objective import answer_logps, pair_scores
from shardwise.runtime.ledger import storage_bytes
from shardwise.runtime.meta_init import MetaInitUnsupported, record_build

REFERENCE_FILE = "reference_logps.npz"


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` without its LoRA adapters inside (peft's ``disable_adapter``, for injected layers).

    peft's ``enable_adapters(False)`` also flips the adapters' ``requires_grad``, which DDP's reducer
    and FSDP2's hooks would see between two forwards; only the flag the layers' forward reads is
    switched here."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # defers peft (optional)

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


def score_batch(session: Any, model: nn.Module, inputs: Any, targets: dict[str, torch.Tensor],
                answers: int, *, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probs of one batch's pairs under ``model``, in eval mode, without
    gradients. ``width``: under pipeline parallel, the rows' fixed width (``preference.pipeline``)."""
    if width:
        inputs, target, per_row = pipe.pipeline_batch(inputs, targets, None, width)

        def per_answer(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            labels, answer, n, _ = pipe.decode(target, per_row)
            return answer_logps(logits, labels, answer, n)[0]  # one value per answer: concatenated

        return pipe.halves(_in_eval(session, model, inputs, target, per_answer))
    segments = session.sequence_chunk(targets["segments"], -1)  # cut as eval_loss cuts the labels (cp)

    def scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.stack(pair_scores(logits, labels, segments, answers, session.sequence_sum))

    out = _in_eval(session, model, inputs, targets["labels"], scores)
    return out[0], out[1]


def _in_eval(session: Any, model: nn.Module, inputs: Any, target: torch.Tensor, fn: Callable) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        return session.eval_loss(model, inputs, target, fn)
    finally:
        model.train(was_training)


def frozen_copy(session: Any, factory: Callable[[], nn.Module], policy: nn.Module) -> nn.Module:
    """A frozen copy of ``policy`` sharded exactly like it (same strategy, mesh and units), holding
    the policy's current values; nothing of it trains."""
    rng = torch.get_rng_state()  # building must not move the run's random stream
    try:
        model, program = record_build(factory)
    except MetaInitUnsupported:
        model, program = factory(), None
    device = torch.device("cpu") if session.layout.offload else session.device

    def materialize(module: nn.Module) -> None:
        # Filled with the recorded init here, then overwritten with the policy's values below.
        program.materialize(module, device, name_of=clean_name)  # type: ignore[union-attr]

    model.requires_grad_(False)
    ctx = dataclasses.replace(session.ctx, materialize=materialize if program is not None else None)
    strategy = session.strategy
    if session.layout.info.shards_over_dp:
        # FSDP2 shards frozen parameters as it shards trained ones (zero2 too: the policy's are shards)
        ref = parallelize(model, strategy, ctx)
    else:
        # Replicated data parallel: each rank holds the whole (TP-sharded) model; DDP would only
        # wrap it for gradients, which it has none of.
        strategy.apply_tp(model, ctx)
        if ctx.materialize is not None:
            ctx.materialize(model)
        ref = model.to(device)
    torch.set_rng_state(rng)
    source = {clean_name(n): p for n, p in policy.named_parameters()}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            src = source[clean_name(name)]
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(src.to_local() if hasattr(src, "to_local") else src)
    ref.eval()
    return ref


def score_pairs(session: Any, model: nn.Module, dataset: Any, collate: Callable, batch_size: int,
                answers_per_row: int, *, width: int = 0) -> np.ndarray:
    """(N, 2) float64 reference log-probs (sums) of every pair of ``dataset``, each data-parallel rank scoring
    its share (every rank runs the same number of equal batches: FSDP and TP ranks step together)."""
    n, dp, rank = len(dataset), session.dp_size, session.dp_rank
    mine = list(range(rank, n, dp))
    per_rank = math.ceil(n / dp)
    if width:  # a pipeline's batches split into its microbatches: every batch full
        per_rank = math.ceil(per_rank / batch_size) * batch_size
    mine += [mine[0] if mine else 0] * (per_rank - len(mine))  # repeats: scored again, the same value
    out = torch.zeros(n, 2, dtype=torch.float64, device=session.device)
    for start in range(0, per_rank, batch_size):
        idx = mine[start:start + batch_size]
        inputs, targets = collate([dataset[i] for i in idx])
        inputs = session.to_device(inputs)
        targets = {k: v.to(session.device) for k, v in targets.items()}
        chosen, rejected = score_batch(session, model, inputs, targets, answers_per_row * targets["labels"].shape[0],
                                       width=width)
        out[idx, 0] = chosen.double()
        out[idx, 1] = rejected.double()
    if session.is_distributed:
        # Each pair is written by one data-parallel rank; its tp (non-dp) peers wrote the same value.
        out = session.all_reduce(out, op="sum") / (session.world_size // dp)
    return out.cpu().numpy()


def fingerprint(dataset: Any, parts: dict[str, Any]) -> str:
    """A key of the pairs' tokens and the settings the reference's log-probs depend on."""
    h = hashlib.sha256(repr(sorted(parts.items())).encode())
    p = dataset.pairs
    for arrays in (p.prompts, p.chosen, p.rejected):
        for a in arrays:
            h.update(np.ascontiguousarray(a, np.int64).tobytes())
            h.update(b"|")
    return h.hexdigest()


def load_scores(path: Path, key: str) -> dict[str, np.ndarray] | None:
    """The saved log-probs at ``path`` when their key is ``key`` (else None)."""
    try:
        with np.load(path) as z:
            if str(z["key"]) != key:
                return None
            return {"train": z["train"], "val": z["val"]}
    except (OSError, KeyError, ValueError):
        return None


def save_scores(path: Path, key: str, scores: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, key=np.asarray(key), **scores)
    tmp.replace(path)


def reference_bytes(mode: str, ref: nn.Module | None, scores: dict[str, np.ndarray] | None) -> int:
    """Bytes this rank holds for the reference: the copy's parameter shards (device), the
    precomputed log-probs (host), nothing with adapters off."""
    if ref is not None:
        return storage_bytes(ref.parameters())
    if scores is not None:
        return sum(a.nbytes for a in scores.values())
    return 0
