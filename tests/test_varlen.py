"""Variable-length attention for packed batches (``shardwise.models.varlen``), on CPU: the documents'
``cu_seqlens`` from doc ids and from positions, and Hugging Face models switched to it giving the
mask path's logits and gradients (Llama, GPT-2, a Mistral and a Qwen2 with sliding windows shorter
than their documents; both paths equal each record alone) without building the T x T mask; padded
and plain batches are unchanged; ``model.attention = "varlen"`` trains the same steps as the mask
through the built-in trainer, and is refused where it cannot run. The CUDA kernel
(``torch.nn.attention.varlen.varlen_attn``) runs the same function on a GPU: not here."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.data.collate import RecordCollator  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models import varlen  # noqa: E402
from shardwise.models.hf import build_hf_model  # noqa: E402


def _records(lengths, vocab=65, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
             "labels": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths]


def test_cu_seqlens_from_doc_ids_and_from_positions():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0], [0, 1, 2, 2, -1, -1]])
    cu, longest = varlen.cu_seqlens(doc)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 12, 13, 14, 16, 18] and longest == 6
    # A row that starts with the same doc id as the previous row ended with is still a new sequence.
    cu, _ = varlen.cu_seqlens(torch.tensor([[0, 0], [0, 0]]))
    assert cu.tolist() == [0, 2, 4]
    # The collator's packed rows: positions restart per record and at the padding tail, so both agree.
    x, _ = RecordCollator(0, pack=True, block_size=32)(_records([7, 12, 5, 9, 30, 3]))
    by_doc, by_pos = varlen.cu_seqlens(x["doc_ids"]), varlen.cu_seqlens_from_positions(x["position_ids"])
    assert by_doc[0].tolist() == by_pos[0].tolist() and by_doc[1] == by_pos[1] == 29  # a record of L tokens fills L - 1
    with pytest.raises(ValueError, match="doc_ids must be"):
        varlen.cu_seqlens(torch.zeros(4, dtype=torch.long))
    assert varlen.kernel(torch.device("cpu"), torch.bfloat16) == "per-document sdpa"


def _windowed(tmp_path, family: str, window: int):
    """A tiny Mistral (every layer slides) or Qwen2 (layer 0 full, layer 1 sliding) config file."""
    cfg = {"model_type": family, "vocab_size": 65, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "sliding_window": window, "tie_word_embeddings": False}
    if family == "qwen2":
        cfg.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, max_window_layers=1)
    else:
        cfg.update(architectures=["MistralForCausalLM"])
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("family", ["llama-tiny", "gpt2-tiny", "mistral-window-6", "qwen2-window-6"])
def test_varlen_attention_equals_the_mask_path(family, tmp_path, monkeypatch):
    source = _windowed(tmp_path, family.split("-")[0], 6) if "window" in family else family
    torch.manual_seed(0)
    model = build_hf_model(source, vocab_size=65)
    recs = _records([7, 12, 5, 9, 30, 14, 3], seed=1)
    packed, targets = RecordCollator(0, pack=True, block_size=40)(recs)
    padded, _ = RecordCollator(0)(recs)

    def run(m, x):
        m.zero_grad()
        logits = m(x)
        if x is packed:
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want, want_grads = run(model, packed)
    want_padded, _ = run(model, padded)
    # The mask path is each record alone (where layers slide, the window is in the explicit masks).
    from shardwise.data.packing import RowSequences

    rows = RowSequences([r["input_ids"] for r in recs], [r["labels"] for r in recs], 40, True, 0).rows
    for row, members in enumerate(rows):
        at = 0
        for i in members:
            n = len(recs[i]["input_ids"]) - 1
            with torch.no_grad():
                alone = model(torch.tensor([recs[i]["input_ids"][:-1]]))[0]
            torch.testing.assert_close(want[row, at:at + n], alone, atol=1e-5, rtol=1e-5)
            at += n
    varlen.enable(model)
    assert varlen.enabled(model.hf)
    # No T x T mask: transformers' mask builders are not asked for one, the attention runs per document.
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        calls.append(q.shape[-2])  # the query length: one document
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got, got_grads = run(model, packed)
    n_layers = model.hf.config.num_hidden_layers
    rows_padding = int((packed["doc_ids"][:, -1] < 0).sum())
    assert len(calls) == n_layers * (7 + rows_padding)  # each record and each row's padding tail, per layer
    assert max(calls) == 29
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    monkeypatch.undo()
    # Padded batches keep transformers' own sdpa path and mask.
    torch.testing.assert_close(run(model, padded)[0], want_padded, atol=1e-6, rtol=1e-6)


def test_enable_refuses_models_that_are_not_transformers_ones():
    from shardwise.models.gpt import GPT, GPT_PRESETS

    with pytest.raises(ConfigError, match="for Hugging Face models"):
        varlen.enable(GPT(GPT_PRESETS["nano"]))


def test_model_attention_varlen_trains_like_the_mask_and_is_refused_where_it_cannot_run(tmp_path):
    from shardwise.core.config import load_config
    from shardwise.verify import run_steps
    from tests.helpers.sft import chat_records, save_qwen2, write_jsonl

    model = save_qwen2(tmp_path / "qwen", seed=1)
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(24, seed=1))

    def cfg(*extra):
        return load_config("hf-sft", [
            f'model.pretrained="{model}"', f'data.path="{chat}"', f'data.cache_dir="{tmp_path / "cache"}"',
            "model.overrides.block_size=192", "train.micro_batch_size=2", "train.lr=1e-3", "train.warmup_steps=1",
            "train.eval_every=0", "train.progress=false", "checkpoint.every=0", *extra])

    sdpa, masked = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        masked.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        mask = run_steps(cfg(), 3, tmp_path / "mask")
        assert masked and all(masked)  # the 4-D document mask
        masked.clear()
        var = run_steps(cfg('model.attention="varlen"'), 3, tmp_path / "varlen")
        assert masked and not any(masked)  # one causal call per document, no mask
    assert var["losses"] == pytest.approx(mask["losses"], rel=1e-5)
    assert mask["losses"][-1] < mask["losses"][0]
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ['model.attention="flash"'])
    # Context parallel takes the whole sequence's mask: refused before any rank starts.
    from shardwise.preflight import check_run

    with pytest.raises(ConfigError, match="with parallel.cp > 1 leave model.attention = 'mask'"):
        check_run(cfg('model.attention="varlen"', "parallel.cp=2", "parallel.nproc=2", 'parallel.strategy="fsdp"'), 2)
    from shardwise.workloads import build_workload

    gpt = load_config(None, ['model.attention="varlen"', "model.preset=nano"])
    with pytest.raises(ConfigError, match="model.attention = 'varlen' is for Hugging Face models"):
        build_workload(gpt.model, gpt.data)


@pytest.mark.parametrize("gqa_flag", [True, False])
def test_the_kernel_path_serves_grouped_query_heads_with_or_without_enable_gqa(monkeypatch, gqa_flag):
    """The CUDA kernel is called with enable_gqa where torch has it (2.13) and with the kv heads
    repeated where it does not (2.11, the first GPU run): both give the per-document SDPA's output.
    The kernel is stood in for by the per-document SDPA path itself (on the CPU; equal heads only)."""
    def kernel_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        if enable_gqa:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return kernel_2_11(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    def kernel_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert q.shape[1] == k.shape[1], "a kernel without enable_gqa needs as many kv heads as query heads"
        out, _ = real(None, *(x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)), None, scaling=scale,
                      cu_seq_lens_q=cu_q, max_length_q=max_q)
        return out.reshape(q.shape)

    real = varlen.varlen_attention
    monkeypatch.setattr(varlen, "kernel", lambda *a, **k: "per-document sdpa")
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    expected, _ = real(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=7)
    monkeypatch.setattr(varlen, "varlen_attn", kernel_2_13 if gqa_flag else kernel_2_11)  # the name it calls
    calls = []
    monkeypatch.setattr(varlen, "kernel", lambda *a, **kw: calls.append(1) or (
        "varlen_attn" if len(calls) == 1 else "per-document sdpa"))
    out, _ = real(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=7)
    torch.testing.assert_close(out, expected)
