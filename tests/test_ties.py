"""Tied parameters through parallelisation (parallel/ties.py): found, re-tied, and a broken tie refused.

The end-to-end proof (a tied Llama under fsdp+tp, dp 2 x tp 2, equal to one process) runs in
test_composed's 4-rank spawn; GPT-2 with eager init under tp in test_tp_gpt2's 2-rank spawn; ties cut
across pipeline stages (one copy per end stage, parallel/pipeline/ties.py) in test_pp_ties.
"""

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.ties import check_ties, retie, tied_groups


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_tied_groups_retie_and_a_broken_tie_is_refused():
    model = Tied()
    groups = tied_groups(model)
    assert groups == [["emb.weight", "head.weight"]]
    check_ties(model, groups)  # intact: nothing to say
    # What TP's parallelize_module does: a new parameter per module, equal values, tie gone.
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    with pytest.raises(ConfigError, match="broke the tie between emb.weight and head.weight.*two separate"):
        check_ties(model, groups)
    retie(model, groups)
    assert model.head.weight is model.emb.weight
    check_ties(model, groups)
    # Tied weights laid out two ways cannot be one tensor.
    model.head.weight = nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ConfigError, match="splits the tied parameters emb.weight and head.weight differently"):
        retie(model, groups)
