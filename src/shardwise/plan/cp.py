"""Planner arithmetic for long sequences: context parallel (all-to-all or ring) and the chunked loss.

Pure arithmetic, no torch (the planner answers in under a second). ``memory.memory_breakdown``
and ``cost.step_time`` call the hooks here; ``cp_candidates`` lists the cp degrees worth offering
for a long ``--seq`` (the search that picks among them lives in the planner's candidate list).

* Activations: under Ulysses every rank holds ``seq / cp`` tokens of every tensor outside
  attention, and inside attention the whole sequence for ``heads / cp`` heads: the same bytes.
  So activations per rank are those of ``seq / cp`` tokens (exact for flash / memory-efficient
  SDPA, whose memory is linear in the sequence; the math kernel's ``heads x seq^2`` scores are
  divided by cp but not by cp^2).
* Communication: per layer, forward, 4 all-to-alls (q, k, v, the attention output) of the
  local ``[tokens/cp, heads/tp x head_dim]`` activations; backward the same again; recomputed
  blocks repeat the forward's. An all-to-all over ``cp`` ranks sends ``(cp-1)/cp`` of its input.
  The cp ranks are consecutive in the data-parallel dimension, ``tp`` ranks apart.
* Ring (``parallel.cp_impl = ring``, ``ring_bytes_per_layer``): every rank keeps its queries and
  all heads; its K/V block travels around the cp ring, one point-to-point step to the next rank at
  a time. Forward ``cp-1`` steps of K and V; backward ``cp-1`` steps of K and V again plus ``cp``
  steps of dK/dV in fp32 (torch's ring backward accumulates them in fp32 and the last step brings
  them home); recomputed blocks repeat the forward's. Each step's transfer is issued before that
  step's attention kernel, so it hides behind the attention compute of the ``cp-1`` remote steps.
  No head rule (the all-to-all needs heads per tp rank divisible by cp); the sequence must be a
  multiple of ``2 cp`` (load-balanced head-tail chunks). ``auto`` is the all-to-all, as at runtime;
  the search offers a degree the heads refuse the all-to-all under ring (``cp_impl_for``).
* Logits: the dense loss keeps fp32 logits (and their log-softmax) for ``tokens x vocab``; the
  chunked loss (``train.loss_chunks``) keeps one chunk (``shardwise.loss.AUTO_CHUNK_BYTES``) and a
  log-sum-exp per token.
"""

from __future__ import annotations

from typing import Any

from shardwise.core.config import AUTO_CHUNK_BYTES, AUTO_DENSE_LOGITS_BYTES, auto_chunks_logits
from shardwise.core.families import CHUNKED_HEAD_FAMILIES

__all__ = ["CHUNKED_HEAD_FAMILIES", "CP_IMPLS", "alltoall_bytes_per_layer", "alltoall_s", "chunk_tokens",
           "chunked_loss_off", "cp_candidates", "cp_comm_s", "cp_degree", "cp_impl_for", "cp_multiple",
           "logits_bytes", "ring_bytes_per_layer", "ring_s"]

# The runtime's rule (shardwise.loss.plan_chunked_head) restated torch-free for the planner, from
# the same owners (config.AUTO_CHUNK_BYTES, families.CHUNKED_HEAD_FAMILIES); tests/test_plan_cp_ep.py
# checks the two agree.
LONG_SEQ = 8192  # from this sequence length on, the planner offers cp candidates

# The runtime's cp rules (shardwise.parallel.context.cp: CP_IMPLS, cp_multiple, check_cp_model's head rule)
# restated torch-free; tests/test_plan_cp_ring.py checks they agree.
CP_IMPLS = ("auto", "alltoall", "ring")


def cp_multiple(cp: int, impl: str) -> int:
    """What the sequence must be a multiple of: ``cp`` chunks, ``2 cp`` under ring (head-tail chunks)."""
    return 2 * cp if impl == "ring" else cp


def cp_impl_for(requested: str, n_heads: int | None, tp: int, cp: int) -> str:
    """The implementation a plan runs cp with: ``requested`` (``--cp-impl``) where the heads allow it;
    ``auto`` is the all-to-all (the runtime's auto) unless the heads per tp rank do not divide by cp,
    then the ring (no head rule). '' where ``alltoall`` was asked for and the heads refuse it."""
    if cp <= 1:
        return "alltoall"
    heads_ok = not n_heads or (n_heads // tp) % cp == 0
    if requested == "ring":
        return "ring"
    if heads_ok:
        return "alltoall"
    return "ring" if requested == "auto" else ""


def cp_degree(layout: Any) -> int:
    """The layout's context-parallel degree (1 for layouts that predate the field)."""
    return int(getattr(layout, "cp", 1) or 1)


def alltoall_bytes_per_layer(spec: Any, seq: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                             cp: int = 1) -> int:
    """Bytes one rank puts into the all-to-alls of one layer's forward (q, k, v and the output)."""
    if cp == 1 or not spec.hidden:
        return 0
    heads = spec.n_heads or 1
    kv = spec.n_kv_heads or heads
    head_dim = spec.head_dim or spec.hidden // heads
    if kv % cp:
        kv = heads  # kv heads fewer than (or not divisible by) cp are repeated to the query heads
    tokens = seq // cp * micro_batch
    per_head = tokens * head_dim * act_bytes
    return (2 * heads // tp + 2 * kv // tp) * per_head  # q and out; k and v


def ring_bytes_per_layer(spec: Any, seq: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                         cp: int = 1) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends to the next around the ring in one layer.

    With ``B = micro_batch x seq/cp x kv_heads/tp x head_dim`` (one K or V block):
    forward ``(cp-1) x 2B x act_bytes``; backward ``(cp-1) x 2B x act_bytes + cp x 2B x 4``
    (K/V again, and dK/dV in fp32 over ``cp`` steps: torch's ring backward keeps them in fp32 and its
    last step returns them to their owner).
    """
    if cp == 1 or not spec.hidden:
        return 0, 0
    heads = spec.n_heads or 1
    kv = spec.n_kv_heads or heads
    head_dim = spec.head_dim or spec.hidden // heads
    block = micro_batch * (seq // cp) * max(1, kv // tp) * head_dim  # elements of one K (or V) block
    forward = (cp - 1) * 2 * block * act_bytes
    return forward, forward + cp * 2 * block * 4


def ring_s(steps: int, size_bytes: float, gbs: float, alpha_s: float = 0.0) -> float:
    """Time of ``steps`` point-to-point ring steps moving ``size_bytes`` in all from each rank."""
    return size_bytes / (gbs * 1e9) + steps * alpha_s if steps > 0 else 0.0


def alltoall_s(cp: int, size_bytes: float, gbs: float, alpha_s: float = 0.0) -> float:
    """Time of one all-to-all of ``size_bytes`` per rank: (cp-1)/cp of it leaves each rank."""
    if cp <= 1:
        return 0.0
    return size_bytes * (cp - 1) / cp / (gbs * 1e9) + (cp - 1) * alpha_s


def cp_comm_s(spec: Any, layout: Any, fabric: Any, act_bytes: int, *, seq: int, micro_batch: int,
              layers: int, recompute: float = 0.0, alpha_s: float = 0.0, impl: str = "alltoall") -> float:
    """cp communication seconds of one micro-batch on this rank: forward + backward (+ recomputed
    forward); the all-to-alls, or under ``impl = "ring"`` the ring's point-to-point steps."""
    cp = cp_degree(layout)
    if cp == 1:
        return 0.0
    if impl == "ring":
        forward, backward = ring_bytes_per_layer(spec, seq, micro_batch, act_bytes, tp=layout.tp, cp=cp)
        gbs = fabric.collective_gbs(cp, layout.tp)  # the ring's links: the cp group's, as the all-to-all's
        fwd = ring_s(cp - 1, forward, gbs, alpha_s)
        return (fwd * (1 + recompute) + ring_s(cp, backward, gbs, alpha_s)) * layers
    size = alltoall_bytes_per_layer(spec, seq, micro_batch, act_bytes, tp=layout.tp, cp=cp)
    gbs = fabric.collective_gbs(cp, layout.tp)  # the cp group: consecutive dp ranks, tp apart
    one = alltoall_s(cp, size / 4, gbs, alpha_s)  # size covers 4 all-to-alls
    return (8 + 4 * recompute) * one * layers


def chunk_tokens(tokens: int, vocab: int, chunks: int | None = None) -> int:
    """Tokens per chunk of the chunked loss (``shardwise.loss.ChunkPlan.chunk_tokens``): ``tokens / N``
    for ``train.loss_chunks = N``, else as many as fit ``AUTO_CHUNK_BYTES`` of fp32 logits."""
    if chunks:
        return max(1, -(-tokens // chunks))
    return min(tokens, max(1, AUTO_CHUNK_BYTES // (4 * vocab)))


def chunked_loss_off(family: str, vocab: int | None, hidden: int | None, chunks: int | None, *, tp: int = 1,
                     pp: int = 1, tokens: int | None = None) -> str:
    """Why the runtime would not chunk the loss here ('' when it does): ``shardwise.loss.plan_chunked_head``.

    ``chunks``: ``train.loss_chunks`` parsed (None auto, 0 off, N). An explicit N where the reason is
    not '' is refused by the runtime; 'auto' quietly stays off. ``tokens``: a micro-batch's tokens on
    one rank, where known: 'auto' leaves a micro-batch with small logits whole
    (``core.config.auto_chunks_logits``, decided per call by the runtime's head).
    """
    if chunks == 0:
        return "train.loss_chunks = 0"
    if family not in CHUNKED_HEAD_FAMILIES or not vocab or not hidden:
        return (f"the model ({family}) has no plain output head the chunked loss knows (the built-in GPT and "
                f"Hugging Face {', '.join(CHUNKED_HEAD_FAMILIES[1:])})")
    if tp > 1:
        return "tensor parallel already splits the logits over the vocabulary (loss_parallel)"
    if pp > 1:
        return "pipeline parallel computes the loss inside its schedule, per microbatch"
    if chunks is None and vocab <= 4 * hidden:
        return f"the vocabulary ({vocab}) is small beside the hidden size ({hidden})"
    if chunks is None and tokens is not None and not auto_chunks_logits(tokens, vocab):
        return (f"a micro-batch's fp32 logits ({4 * tokens * vocab / 2**30:.2f} GiB) are within "
                f"{AUTO_DENSE_LOGITS_BYTES / 2**30:g} GiB: 'auto' builds them whole, which is faster")
    return ""


def logits_bytes(tokens: int, vocab: int, *, tp: int = 1, chunked: bool = False, chunks: int | None = None) -> int:
    """Bytes the output head + loss hold for ``tokens`` tokens (fp32 logits; vocab-parallel under TP).

    Chunked (``chunks``: ``train.loss_chunks``, None = auto size): one chunk's fp32 logits, softmax
    and gradient, and one fp32 log-sum-exp per token.
    """
    if chunked:
        return 3 * 4 * chunk_tokens(tokens, vocab, chunks) * vocab + 4 * tokens
    return 2 * 4 * tokens * vocab // tp  # the fp32 logits and their log-softmax


def cp_candidates(world: int, seq: int, n_heads: int | None, *, tp: int = 1, min_chunk: int = 1024,
                  impl: str = "alltoall") -> list[int]:
    """cp degrees to offer for a ``seq``-token run on ``world`` ranks at tensor-parallel ``tp``.

    [1] below ``LONG_SEQ``; else every cp > 1 that divides the data-parallel ranks, that ``impl``
    (``--cp-impl``) can run (``cp_impl_for``: the all-to-all needs the heads per tp rank divisible by
    cp) and whose ``cp_multiple`` divides the sequence, keeping at least ``min_chunk`` tokens per rank.
    """
    if seq < LONG_SEQ or not n_heads:
        return [1]
    dp = world // tp

    def runs(cp: int) -> bool:
        chosen = cp_impl_for(impl, n_heads, tp, cp)
        return bool(chosen) and seq % cp_multiple(cp, chosen) == 0

    return [1] + [cp for cp in range(2, dp + 1) if dp % cp == 0 and seq // cp >= min_chunk and runs(cp)]
