"""The DPO loss from per-token log-probs (Rafailov et al. 2023; the formulas TRL's DPOTrainer uses).

For pair ``i``, ``log pi(y|x)`` is the SUM of the log-probs of the answer's tokens under the policy
(prompt tokens never count: their labels are -100), and the same under the reference. With

    z_i = [log pi(y_c|x) - log pi(y_r|x)] - [log ref(y_c|x) - log ref(y_r|x)]

* ``sigmoid`` (DPO; ``label_smoothing`` eps gives conservative DPO, Mitchell 2023):
  ``loss_i = -(1 - eps) log sigmoid(beta z_i) - eps log sigmoid(-beta z_i)``;
* ``ipo`` (Azar et al. 2023): the same ``z_i`` from log-probs AVERAGED over each answer's tokens,
  ``loss_i = (z_i - 1 / (2 beta))^2``.

Rewards (reported, not trained): ``beta (log pi(y|x) - log ref(y|x))`` for each answer; accuracy is
the fraction of pairs whose chosen reward exceeds the rejected one, margin their mean difference.
A step's loss is the mean over the global batch's pairs: every micro-batch holds the same number of
pairs, so the mean of micro-batch means (Session.backward's 1/A, data-parallel averaging) is it.

SimPO and ORPO were left out: both drop the reference model (the part of the work that is hard to
get right when sharded, and that the tests prove), and ORPO adds an SFT term over the chosen
answers that needs its own token-mean normalisation. IPO costs one line on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's log-prob of its label (0 where the label is -100), fp32 or wider, ``labels.shape``.

    Written as a cross-entropy so that tensor parallel's ``loss_parallel`` computes it on
    vocabulary-sharded logits without gathering them."""
    flat = logits.flatten(0, -2)
    out = -F.cross_entropy(flat.to(torch.promote_types(flat.dtype, torch.float32)), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="none")
    full = getattr(out, "full_tensor", None)  # a DTensor under loss_parallel: every tp rank holds it all
    if full is not None:
        out = full()
    return out.view(labels.shape)


def answer_logps(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor,
                 answers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-probs, number of tokens) of each of ``answers`` answers; ``segments`` says which
    answer each position's label belongs to (-1: none). Under context parallel these are one rank's
    chunk's (``Session.sequence_chunk`` cuts ``segments``; ``Session.sequence_sum`` adds the chunks)."""
    tok = token_logps(logits, labels)
    seg = segments.reshape(-1).to(tok.device)
    keep = (seg >= 0) & (labels.reshape(-1).to(tok.device) != IGNORE_INDEX)
    idx = seg.clamp(min=0)
    sums = torch.zeros(answers, dtype=tok.dtype, device=tok.device).index_add(0, idx, tok.reshape(-1) * keep)
    counts = torch.zeros(answers, dtype=tok.dtype, device=tok.device).index_add(0, idx, keep.to(tok.dtype))
    return sums, counts


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                      ref_rejected: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
                      loss: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from per-answer log-probs (sums for
    ``sigmoid``, per-token means for ``ipo``); the rewards are detached."""
    ref_chosen = ref_chosen.to(policy_chosen.dtype)
    ref_rejected = ref_rejected.to(policy_chosen.dtype)
    z = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    elif loss == "ipo":
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {loss!r}; allowed: sigmoid, ipo")
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def pair_logps(sums: torch.Tensor, counts: torch.Tensor, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probs of a batch's pairs from ``answer_logps``'s sums and counts:
    sums for DPO, per-token means for IPO."""
    values = sums / counts.clamp(min=1) if loss == "ipo" else sums
    half = values.shape[0] // 2
    return values[:half], values[half:]


def pair_scores(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, answers: int, loss: str,
                sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probs of a batch's pairs: ``answer_logps``, added over the context-parallel
    ranks by ``sequence_sum`` (``Session.sequence_sum``; None: the whole sequences are here), then
    ``pair_logps``."""
    sums, counts = answer_logps(logits, labels, segments, answers)
    if sequence_sum is not None:
        sums, counts = sequence_sum(sums), sequence_sum(counts)
    return pair_logps(sums, counts, loss)
