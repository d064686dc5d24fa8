"""Tensor parallel (+ sequence parallel) on 2 gloo ranks equals the single-process reference.

Tolerance (the model in float64, 5 AdamW steps at lr=1e-3): losses and final parameters within 1e-9
absolute. TP changes only the summation order of the row-parallel matmuls (an all-reduce of two
partial sums) and of the vocabulary-parallel cross-entropy; in float64 what AdamW makes of that
noise stays ~1e-10 per step on any machine, while a defect moves a parameter by O(lr) = 1e-3 (the
derivation is in ``shardwise.testing.default_dtype``).
"""

import pytest
import torch

from shardwise.core.config import ParallelConfig
from shardwise.core.layout import resolve_layout
from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPT_PRESETS, GPTConfig
from shardwise.parallel.tensor.tp import check_tp_model
from shardwise.testing import default_dtype, run_distributed
from tests.helpers.mp import hf_train, merged_params, mp_train

LOSS_ATOL = 1e-9
PARAM_ATOL = 1e-9

COLWISE = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
           "v_proj.bias", "mlp.fc.weight", "mlp.fc.bias", "lm_head.weight", "tok_emb.weight",
           "pos_emb.weight")  # embeddings are split over rows (vocabulary / positions): dim 0
ROWWISE = ("o_proj.weight", "mlp.proj.weight")  # split over the input dim: dim 1


def assert_parity(ref: dict, ranks: list[dict]) -> None:
    assert len(ref["losses"]) >= 5
    for r in ranks:
        for step, (a, b) in enumerate(zip(ref["losses"], r["losses"])):
            assert abs(a - b) < LOSS_ATOL, f"step {step}: reference {a} vs {b}"
    got = merged_params(ranks)
    assert set(got) == set(ref["params"])
    for name, p in ref["params"].items():
        diff = (p - got[name]).abs().max().item()
        assert diff < PARAM_ATOL, f"{name}: max abs diff {diff}"


def expected_tp_bytes(tp: int, cfg: GPTConfig) -> int:
    """Parameter storage bytes each rank holds under the GPT TP plan.

    Split dims are cut in ceil(n / tp) chunks; the last rank's shorter chunk of an uneven split
    (vocabulary 65 over 2 ranks: 33 + 32 rows) sits in a storage of the full chunk size, which is
    what the ledger counts, so every rank holds the same bytes.
    """
    total = 0
    with default_dtype(torch.float64):  # as the parity runs train
        model = GPT(cfg)
    for name, p in model.named_parameters():
        if name.endswith(COLWISE) or name.endswith(ROWWISE):
            dim = 1 if name.endswith(ROWWISE) else 0
            total += p.numel() // p.shape[dim] * -(-p.shape[dim] // tp) * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def test_tp_matches_single_process_and_splits_parameters():
    ref = mp_train(0, 1, "single")
    ranks = run_distributed(mp_train, 2, strategy="tp", evaluate=True)
    assert_parity(ref, ranks)
    cfg = GPT_PRESETS["nano"]
    # Ledger bytes (local shards): matrices halve, vocab 65 splits 33/32, norms are replicated.
    assert [r["param_bytes"] for r in ranks] == [expected_tp_bytes(2, cfg)] * 2
    # Gradients are stored sharded like their parameters, the embeddings' included (whole-table
    # Replicate gradients would add 6,144 bytes here). Rank 1's 32 vocab rows need no padding.
    assert [r["grad_bytes"] for r in ranks] == [expected_tp_bytes(2, cfg), expected_tp_bytes(2, cfg) - 64 * 8]
    full = sum(p.numel() * 8 for p in GPT(cfg).parameters())
    assert expected_tp_bytes(2, cfg) < 0.55 * full
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"]


def test_tp_with_sequence_parallel_and_activation_checkpointing():
    ref = mp_train(0, 1, "single", accum=2)
    ranks = run_distributed(mp_train, 2, strategy="tp", sequence_parallel=True, accum=2,
                            activation_checkpointing="full")
    assert_parity(ref, ranks)
    assert all(r["grad_bytes"] <= r["param_bytes"] for r in ranks)


def test_tp_llama_hf_model_with_sequence_parallel():
    ref = hf_train(0, 1)
    ranks = run_distributed(hf_train, 2, strategy="tp", sequence_parallel=True)
    assert_parity(ref, ranks)


def test_tp_degree_must_divide_heads_and_hidden():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_head=6, n_embd=48, n_layer=2))
    check_tp_model(model, 2)
    check_tp_model(model, 3)
    with pytest.raises(ConfigError, match="n_head=6.*not divisible by 4"):
        check_tp_model(model, 4)
    with pytest.raises(ConfigError, match="Sequential has none"):
        check_tp_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)
    with pytest.raises(ConfigError, match="parallel.pp=2 is set"):
        resolve_layout(ParallelConfig(strategy="tp", pp=2), 2)
    with pytest.raises(ConfigError, match=r"dp x tp x pp must equal the world size"):
        resolve_layout(ParallelConfig(strategy="tp", tp=2), 4)


def _embedding_rank(rank: int, world_size: int) -> dict:
    """A vocabulary-parallel embedding on ``world_size`` ranks against the whole table on one: the
    output and the table's gradient, and the row counts of every table gradient the backward made."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.parallel.tensor.embedding import VocabParallelEmbedding

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))

    class Rows(TorchDispatchMode):  # the shape of each embedding_dense_backward output
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.rows.append(out.shape[0])
            return out

    out: dict = {}
    for name, layout in (("replicate", Replicate()), ("sequence", Shard(1))):
        torch.manual_seed(0)
        # 65 rows over 2 ranks: 33 + 32, an uneven split; padding_idx on the second rank's rows.
        full = torch.nn.Embedding(65, 8, padding_idx=40, dtype=torch.float64)
        local = torch.nn.Embedding(65, 8, padding_idx=40, dtype=torch.float64)
        local.load_state_dict(full.state_dict())
        ids = torch.randint(0, 65, (2, 6), generator=torch.Generator().manual_seed(1))
        ids[0, 0] = 40
        weights = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        (full(ids) * weights).sum().backward()
        parallelize_module(local, mesh, VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=layout,
                                                               use_local_output=False))
        with Rows() as rows:
            y = local(ids)
            (y.full_tensor() * weights).sum().backward()
        out[name] = {"out": float((y.full_tensor() - full(ids)).abs().max()),
                     "grad": float((local.weight.grad.full_tensor() - full.weight.grad).abs().max()),
                     "grad_rows": local.weight.grad.to_local().shape[0], "backward_rows": rows.rows}
    return out


def test_vocab_parallel_embedding_keeps_the_table_gradient_row_sharded():
    """torch's RowwiseParallel embedding computes the whole table's gradient on every TP rank
    (DTensor has no row-sharded embedding backward): 12 GiB on a rehearsed llama-3-405b tp 8 first
    stage. The plans' VocabParallelEmbedding looks up the local rows: the same output and gradient,
    and the backward only ever makes this rank's rows."""
    ranks = run_distributed(_embedding_rank, 2, timeout_s=120)
    for rank, result in enumerate(ranks):
        for name, r in result.items():
            assert r["out"] < 1e-12 and r["grad"] < 1e-12, (rank, name, r)
            assert r["grad_rows"] == (33, 32)[rank] and r["backward_rows"] == [(33, 32)[rank]], (rank, name, r)
