"""The DPO loss from per-token log-probs (Rafailov et al. 2023; TRL's ``DPOTrainer`` formulas, checked
against TRL itself in ``tests/test_preference_trl.py``).

For pair ``i``, ``log pi(y|x)`` is the SUM of the log-probs of the answer's tokens under the policy
(prompt tokens never count: their labels are -100), and the same under the reference. With the
log-ratios ``c_i = log pi(y_c|x) - log ref(y_c|x)`` and ``r_i = log pi(y_r|x) - log ref(y_r|x)``:

* ``sigmoid`` (DPO), ``z_i = c_i - r_i``:
  ``loss_i = -(1 - eps) log sigmoid(beta z_i) - eps log sigmoid(-beta z_i)``. ``label_smoothing`` eps
  is conservative DPO (Mitchell 2023), what TRL's sigmoid loss did before 0.29; TRL's sigmoid has no
  smoothing since (its ``label_smoothing`` serves other losses, e.g. ``robust``), so the two agree at
  eps = 0, the default;
* ``ipo`` (Azar et al. 2023), each log-ratio AVERAGED over its answer's tokens (TRL's normalisation):
  ``z_i = c_i / |y_c| - r_i / |y_r|``, ``loss_i = (z_i - 1 / (2 beta))^2``.

Rewards (reported, not trained): ``beta c_i`` and ``beta r_i``, from the sums whatever the loss (as
TRL reports them); accuracy is the fraction of pairs whose chosen reward exceeds the rejected one,
margin their mean difference. A step's loss is the mean over the global batch's pairs: every
micro-batch holds the same number of pairs, so the mean of micro-batch means (Session.backward's
1/A, data-parallel averaging) is it.

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


def _scored(labels: torch.Tensor, segments: torch.Tensor,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(answer index, whether it is scored) of every position, flattened."""
    seg = segments.reshape(-1).to(device)
    return seg.clamp(min=0), (seg >= 0) & (labels.reshape(-1).to(device) != IGNORE_INDEX)


def answer_logps(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor,
                 answers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-probs, number of tokens) of each of ``answers`` answers; ``segments`` says which
    answer each position's label belongs to (-1: none). Under context parallel these are one rank's
    chunk's (``Session.sequence_chunk`` cuts ``segments``; ``Session.sequence_sum`` adds the chunks)."""
    tok = token_logps(logits, labels)
    idx, keep = _scored(labels, segments, tok.device)
    sums = torch.zeros(answers, dtype=tok.dtype, device=tok.device).index_add(0, idx, tok.reshape(-1) * keep)
    return sums, answer_lengths(labels, segments, answers).to(tok)


def answer_lengths(labels: torch.Tensor, segments: torch.Tensor, answers: int) -> torch.Tensor:
    """The number of scored tokens of each of ``answers`` answers (float32; what IPO averages over)."""
    idx, keep = _scored(labels, segments, segments.device)
    return torch.zeros(answers, dtype=torch.float32, device=segments.device).index_add(0, idx, keep.float())


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                      ref_rejected: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
                      loss: str = "sigmoid",
                      lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from per-answer log-prob SUMS; ``lengths``
    (the chosen and the rejected answers' token counts) is needed for ``ipo``. The rewards are detached."""
    chosen = policy_chosen - ref_chosen.to(policy_chosen.dtype)
    rejected = policy_rejected - ref_rejected.to(policy_chosen.dtype)
    if loss == "sigmoid":
        z = chosen - rejected
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    elif loss == "ipo":
        if lengths is None:
            raise ValueError("the ipo loss averages each answer's log-ratio over its tokens: pass lengths")
        z = chosen / lengths[0].to(chosen).clamp(min=1) - rejected / lengths[1].to(chosen).clamp(min=1)
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {loss!r}; allowed: sigmoid, ipo")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def pair_halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) parts of per-answer values (``answer_logps``'s sums, ``answer_lengths``):
    a batch's chosen answers come first, then its rejected ones in the same order."""
    half = values.shape[0] // 2
    return values[:half], values[half:]


def pair_scores(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, answers: int,
                sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probs of a batch's pairs: ``answer_logps``'s sums, added over the
    context-parallel ranks by ``sequence_sum`` (``Session.sequence_sum``; None: the whole sequences
    are here), then ``pair_halves``."""
    sums = answer_logps(logits, labels, segments, answers)[0]
    return pair_halves(sequence_sum(sums) if sequence_sum is not None else sums)
