"""Tiny pretrained Hugging Face folders made in the test (save_pretrained, never downloaded), and
the rank functions of the pretrained / LoRA / meta-init tests (module-level so spawned ranks can
import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.core.config import LoraConfig, ParallelConfig
from shardwise.runtime import ledger
from shardwise.runtime.session import Session
from shardwise.testing import fixed_batches, lm_loss, train_fixed_batches
from tests.helpers.mp import full_params

VOCAB = 65


def save_tiny(folder: Path, family: str = "llama", *, shard_kb: int = 0, seed: int = 0, vocab: int = VOCAB,
              dtype: torch.dtype = torch.float32) -> Path:
    """Save a randomly initialised tiny ``llama`` or ``gpt2`` with save_pretrained; return ``folder``.

    ``shard_kb`` > 0 splits the weights into several files of at most that size plus
    model.safetensors.index.json (save_pretrained's ``max_shard_size``).
    """
    from shardwise.models.hf import build_hf_model

    torch.manual_seed(seed)
    hf = build_hf_model(f"{family}-tiny", vocab_size=vocab).hf.to(dtype)
    kwargs = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    hf.save_pretrained(str(folder), **kwargs)
    return folder


def reference_model(folder: Path) -> torch.nn.Module:
    """The plain transformers model of a folder, fp32, as users load it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa", dtype=torch.float32)


def reference_losses(folder: Path, steps: int, global_batch: int, seq: int, *, lora: LoraConfig | None = None,
                     seed: int = 0, lr: float = 1e-2, max_norm: float = 0.0) -> dict:
    """One process, plain transformers (+ peft ``get_peft_model``): the losses, the gradient norms
    (clipped to ``max_norm`` when > 0) and the final weights."""
    model = reference_model(folder)
    if lora is not None:
        from peft import get_peft_model

        from shardwise.models.lora import peft_lora_config

        # shardwise's documented LoRA init: the session seed, then the adapters' draws.
        torch.manual_seed(seed)
        model = get_peft_model(model, peft_lora_config(lora, model.config.model_type))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    data = fixed_batches(steps, global_batch, seq, VOCAB)
    losses, norms = [], []
    for step in range(steps):
        x, y = data[step, :, :-1], data[step, :, 1:]
        loss = lm_loss(model(input_ids=x).logits, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state}


def hf_case(rank: int, world_size: int, folder: str, strategy: str, steps: int = 1, global_batch: int = 4,
            seq: int = 16, lora: dict | None = None, init: str = "meta", lr: float = 1e-2,
            ckpt_dir: str = "", **options: object) -> dict:
    """Load ``folder`` under ``strategy`` through Session.build/prepare and train ``steps`` fixed batches.

    Returns the per-step losses, this rank's full parameters (DTensors gathered), which parameters
    the optimizer holds, and the ledger's param bytes; saves a checkpoint to ``ckpt_dir`` if given.
    """
    from shardwise.models.hf import build_hf_model

    settings = LoraConfig(**lora) if lora else None
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    model = session.build(lambda: build_hf_model(pretrained=folder, lora=settings), init=init)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model, opt = session.prepare(model, opt)
    optimized = {id(p) for g in opt.param_groups for p in g["params"]}
    from shardwise.models.names import clean_name

    in_optimizer = sorted(clean_name(n) for n, p in model.named_parameters() if id(p) in optimized)
    data = fixed_batches(steps, global_batch, seq, VOCAB)
    losses = train_fixed_batches(session, model, opt, data)["losses"]
    if ckpt_dir:
        # Written in the background while the parameters are gathered below (the session's close
        # waits for it): every strategy these cases cover resumes from an asynchronous save.
        session.save(ckpt_dir, model, opt, step=steps, async_=True)
    result = {"losses": losses, "params": full_params(model), "in_optimizer": in_optimizer,
              "param_bytes": ledger.param_bytes(model), "grad_bytes": session.last_grad_bytes,
              "optim_bytes": ledger.optimizer_bytes(opt), "notes": list(session.notes),
              "trainable_only": session.trainable_only}
    session.close()
    return result


def hf_cases(rank: int, world_size: int, cases: list[dict]) -> list:
    """Several ``hf_case`` runs in the same ranks (one spawn); an error is returned as its message.

    A case with ``resume=True`` runs ``resume_lora`` instead (e.g. on a checkpoint an earlier case saved).
    """
    out = []
    for case in cases:
        case = dict(case)
        run = resume_lora if case.pop("resume", False) else hf_case
        try:
            out.append(run(rank, world_size, **case))
        except Exception as e:  # noqa: BLE001 - the test asserts on refusals case by case
            from shardwise.errors import ShardwiseError

            if not isinstance(e, ShardwiseError):
                raise
            out.append(f"{type(e).__name__}: {e}")
    return out


def resume_lora(rank: int, world_size: int, folder: str, strategy: str, ckpt_dir: str, lora: dict,
                **options: object) -> dict:
    """Build a LoRA model afresh and load a LoRA checkpoint into it; return the full parameters."""
    from shardwise.models.hf import build_hf_model

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=123)  # type: ignore[arg-type]
    model = session.build(lambda: build_hf_model(pretrained=folder, lora=LoraConfig(**lora)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = session.prepare(model, opt)
    loaded = session.load(ckpt_dir, model, opt)
    result = {"params": full_params(model), "step": loaded.step}
    session.close()
    return result


def meta_vs_eager(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case build the same model eagerly and on meta under one strategy; return both.

    The vocabularies divide by 2: with an uneven split, DTensor's eager scatter leaves the smaller
    TP shard inside a padded buffer, which the ledger counts (the meta path allocates it exactly).
    """
    import dataclasses

    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.models.hf import build_hf_model

    def factory(kind: str):  # noqa: ANN202
        if kind == "gpt":
            return lambda: GPT(dataclasses.replace(GPT_PRESETS["nano"], vocab_size=64))
        return lambda: build_hf_model(kind, vocab_size=64)  # even vocabulary: equal TP shards

    out = []
    for case in cases:
        opts = dict(case.get("options", {}))
        pair = {}
        for init in ("eager", "meta"):
            session = Session(parallel=ParallelConfig(strategy=case["strategy"], **opts), seed=7)
            model = session.build(factory(case["kind"]), init=init)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model, opt = session.prepare(model, opt)
            pair[init] = {"params": full_params(model), "param_bytes": ledger.param_bytes(model),
                          "after": torch.rand(4)}  # the global RNG continues as after an eager build
            session.close()
        out.append(pair)
    return out
