"""A workload = a model builder, train/val datasets, a loss, and how to report it.

Built from the ``[model]`` and ``[data]`` config sections. The ``custom`` kinds take
``"module:function"`` factories, so a user's own model and data go through the same recipe/TOML
mechanism (and ``shardwise verify``) as the built-in ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from shardwise.core.config import DataConfig, LoraConfig, ModelConfig, PreferenceConfig, Rule, check_value
from shardwise.core.families import DATA_KINDS, MODEL_KINDS, MOE_FAMILIES, RECORD_KINDS
from shardwise.data.cifar import load_cifar10
from shardwise.data.shakespeare import load_shakespeare
from shardwise.errors import ConfigError, did_you_mean, unknown_choice
from shardwise.fsutil import real_path
from shardwise.habits import other_tools_hint
from shardwise.models.adapter import tokenizer_home
from shardwise.models.cnn import build_cnn, cnn_config, cnn_flops_per_sample
from shardwise.models.gpt import GPT, GPT_PRESETS, gpt_flops_per_token
from shardwise.models.hf import build_hf_model
from shardwise.models.hf_config import hf_family, read_hf_config, resolve_hf_config
from shardwise.models.moe import with_aux_loss
from shardwise.models.pretrained import inspect_pretrained
from shardwise.models.varlen import with_varlen


def cross_entropy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for (B, T, V) language-model logits or (B, C) class logits."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


@dataclass
class Workload:
    name: str
    build_model: Callable[[], nn.Module]
    train_set: Dataset
    val_set: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    tokens_per_sample: int = 1  # sequence length for language models, 1 for images
    flops_per_token: float | None = None
    # Family name used by tensor/pipeline plans ("gpt", "llama", ...); "" if unknown.
    family: str = ""
    sample_text: Callable[[nn.Module, torch.device, int, int], str] | None = None
    # What building the data found or did (files, tokens, cache hit), logged by the trainer.
    notes: list[str] = dataclasses.field(default_factory=list)
    # The step's loss is sum(token losses) / (trained tokens of the whole global batch), not a mean of
    # per-micro-batch means (runtime.token_loss): for labels with -100 (prompts, padding, packing).
    token_loss: bool = False
    # How a list of items becomes a batch (None: torch's default_collate). Records: dynamic padding
    # (shardwise.data.collate.collate_rows cuts the columns after the batch's last real token).
    collate_fn: Callable[[list[Any]], Any] | None = None

    @property
    def plain_token_ce(self) -> bool:
        """Whether the training loss is the plain token-mean cross-entropy, the one loss the chunked
        head computes (shardwise.loss): not the token-sum of records, not CE + an MoE aux loss."""
        return not self.token_loss and self.loss_fn is cross_entropy_loss


def import_factory(spec: str, key: str) -> Callable[..., Any]:
    """Import ``module:function``; ConfigError says what failed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} must look like 'package.module:function', got {spec!r}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({e}). Is it on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no callable {attr!r}.")
    return fn


def check_call(fn: Callable[..., Any], kwargs: dict[str, Any], key: str, spec: str) -> None:
    """ConfigError unless ``fn(**kwargs)`` fits ``fn``'s signature (checked before any rank starts)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will tell
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{key} {kwargs} do not fit {spec}{signature}: {e}. Pass only the keyword "
                          "arguments it takes.") from None


def _module_from(factory: Callable[..., Any], kwargs: dict[str, Any], spec: str) -> nn.Module:
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory {spec!r} returned a {type(model).__name__}, not a torch.nn.Module; "
                          "it must build and return the model.")
    return model


# The GPT's options: types from GPTConfig, bounds here (far beyond any trainable size; a typo such
# as an extra zero or a sign is an error before any rank starts).
GPT_OVERRIDE_RULES = {
    "vocab_size": Rule(gt=0, le=2**22), "block_size": Rule(gt=0, le=2**20), "n_layer": Rule(gt=0, le=1024),
    "n_head": Rule(gt=0, le=1024), "n_embd": Rule(gt=0, le=2**16), "dropout": Rule(ge=0.0, lt=1.0),
    # Mixture of experts (models/moe.py).
    "n_experts": Rule(ge=0, le=4096), "moe_top_k": Rule(gt=0, le=64), "moe_every": Rule(gt=0, le=1024),
    "moe_shared_experts": Rule(ge=0, le=64), "moe_hidden": Rule(ge=0, le=2**18),
    "moe_aux_coef": Rule(ge=0.0, le=10.0), "moe_z_coef": Rule(ge=0.0, le=10.0),
}


def _gpt_config(mc: ModelConfig, vocab_size: int) -> Any:
    if mc.preset not in GPT_PRESETS:
        raise unknown_choice("GPT preset", mc.preset, GPT_PRESETS)
    base = GPT_PRESETS[mc.preset]
    types = typing.get_type_hints(type(base))
    values = {}
    for key, value in mc.overrides.items():
        if key not in types:
            raise ConfigError(f"unknown model.overrides key {key!r}.{did_you_mean(key, types)}"
                              f"{other_tools_hint(f'model.overrides.{key}')} "
                              f"Valid: {', '.join(sorted(types))}.")
        values[key] = check_value(f"model.overrides.{key}", value, types[key], GPT_OVERRIDE_RULES.get(key))
    # The data's vocabulary, unless model.overrides.vocab_size sets it (e.g. nanoGPT's padded 50304).
    cfg = dataclasses.replace(base, **{"vocab_size": vocab_size, **values})
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"model.overrides: n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head} "
                          "(each head gets n_embd / n_head dimensions).")
    return cfg


def block_size_of(mc: ModelConfig) -> int:
    """Sequence length the data must be cut to, for language-model workloads."""
    if mc.kind == "gpt":
        return _gpt_config(mc, 65).block_size
    return int(mc.overrides.get("block_size", mc.overrides.get("seq_len", 128)))


def _is_dataset(d: Any) -> bool:
    """True for what ``Session.dataloader`` takes: a map-style dataset or a torch IterableDataset."""
    return isinstance(d, IterableDataset) or (hasattr(d, "__len__") and hasattr(d, "__getitem__"))


def preference_step_only(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Preference pairs have no per-batch loss of this form: the DPO step (shardwise.preference.step) runs them."""
    raise ConfigError("preference data (data.kind = 'preference') trains with train.objective = 'dpo', whose step "
                      "scores chosen and rejected answers against a reference; it has no plain loss function.")


def build_workload(mc: ModelConfig, dc: DataConfig, lora: LoraConfig | None = None,
                   preference: PreferenceConfig | None = None) -> Workload:
    """Build the workload named by the model and data config sections (and ``[lora]`` adapters,
    ``[preference]`` fields)."""
    if mc.kind not in MODEL_KINDS:
        raise unknown_choice("model kind", mc.kind, MODEL_KINDS)
    if dc.kind not in DATA_KINDS:
        raise unknown_choice("data kind", dc.kind, DATA_KINDS)
    if dc.kind in ("text", "preference", *RECORD_KINDS) and not dc.tokenizer and mc.pretrained:
        # A model folder usually holds its tokenizer (save_pretrained of both): use it by default; a
        # PEFT adapter folder usually holds none, and then its base's is the one.
        dc = dataclasses.replace(dc, tokenizer=tokenizer_home(mc.pretrained))

    tokens_per_sample, vocab_size, tokenizer = 1, None, None
    max_token_id: int | None = None
    notes: list[str] = []
    token_loss = False
    collate_fn = None
    if dc.kind in RECORD_KINDS:
        from shardwise.data.sft import load_instruct  # defers numpy

        seq = block_size_of(mc)
        lm = load_instruct(dc, seq)
        train, val, notes = lm.train, lm.val, lm.notes
        tokens_per_sample, vocab_size, max_token_id, token_loss = seq, lm.vocab_size, lm.max_token_id, True
        from shardwise.data.collate import collate_rows  # defers numpy

        collate_fn = collate_rows
    elif dc.kind == "preference":
        from shardwise.preference.batches import load_preference  # defers numpy

        seq = block_size_of(mc)
        train, val, collate_fn, facts = load_preference(dc, preference or PreferenceConfig(), seq)
        notes, vocab_size, max_token_id = facts["notes"], facts["vocab_size"], facts["max_token_id"]
        tokens_per_sample = seq
    elif dc.kind in ("text", "tokens"):
        seq = block_size_of(mc)
        if dc.kind == "text":
            from shardwise.data.text import load_text  # defers numpy

            lm = load_text(dc, seq)
        else:
            from shardwise.data.tokens import load_tokens  # defers numpy

            lm = load_tokens(dc, seq)
        train, val, tokenizer, notes = lm.train, lm.val, lm.tokenizer, lm.notes
        if dc.packed:
            if dc.kind != "text":
                raise ConfigError("data.pack = true needs to know where documents start: it works for data.kind "
                                  "'text' (documents end with the tokenizer's EOS), 'chat' and 'instruct'; "
                                  "pre-tokenised 'tokens' data has no document boundaries to pack by.")
            from shardwise.data.packing import DocumentSequences  # defers numpy

            eos = tokenizer.eos_id
            train, val, token_loss = DocumentSequences(train, eos), DocumentSequences(val, eos), True
            notes.append(f"data: pack = true: attention kept within documents (each EOS, id {eos}, starts one)")
        # Without a tokenizer (pre-tokenised ids) the data knows only its largest id.
        tokens_per_sample, vocab_size, max_token_id = seq, lm.vocab_size or lm.max_token_id + 1, lm.max_token_id
    elif dc.kind == "shakespeare":
        seq = block_size_of(mc)
        train, val, tokenizer = load_shakespeare(dc.path, seq, dc.val_fraction)
        tokens_per_sample, vocab_size = seq, tokenizer.vocab_size
        # Character ids: the text uses every character of its vocabulary.
        max_token_id = tokenizer.vocab_size - 1
    elif dc.kind == "cifar10":
        if not dc.path:
            raise ConfigError("data.kind = 'cifar10' needs data.path: the folder holding the "
                              "CIFAR-10 python batches (data_batch_1..5, test_batch).")
        train, val = load_cifar10(dc.path)
    else:
        if not dc.factory:
            raise ConfigError("data.kind = 'custom' needs data.factory = 'module:function' returning "
                              "(train_dataset, val_dataset).")
        out = import_factory(dc.factory, "data.factory")()
        if not (isinstance(out, tuple) and len(out) == 2 and all(_is_dataset(d) for d in out)):
            what = (f"({', '.join(type(d).__name__ for d in out)})" if isinstance(out, tuple)
                    else type(out).__name__)
            raise ConfigError(f"data.factory {dc.factory!r} must return (train_dataset, val_dataset), each a "
                              f"map-style dataset (with __len__ and __getitem__) or a torch IterableDataset; "
                              f"it returned {what}.")
        train, val = out

    family, flops, sample = "", None, None
    _check_model_takes_data(mc, dc)
    loss_fn = preference_step_only if dc.kind == "preference" else cross_entropy_loss
    if mc.attention != "mask" and mc.kind != "hf":
        raise ConfigError(f"model.attention = {mc.attention!r} is for Hugging Face models (model.kind = 'hf'); "
                          f"model.kind = {mc.kind!r} attends within packed documents through its own mask.")
    if mc.kind == "gpt":
        gcfg = _gpt_config(mc, vocab_size or 65)
        _check_token_ids(max_token_id, gcfg.vocab_size, dc)
        build = lambda: GPT(gcfg)  # noqa: E731
        family, flops = "gpt", gpt_flops_per_token(gcfg)
        if gcfg.n_experts:
            # The routers' load-balancing and z losses join the training loss (models/moe.py); with
            # records / packed rows they join the scaled token sum with scale 1 (runtime/trainer.py).
            loss_fn = with_aux_loss(cross_entropy_loss)
        if tokenizer is not None:
            sample = _text_sampler(tokenizer)
    elif mc.kind == "cnn":
        build = lambda: build_cnn(**mc.overrides)  # noqa: E731
        # One image is one "token" for throughput and FLOP figures.
        family, flops = "cnn", cnn_flops_per_sample(cnn_config(**mc.overrides))
    elif mc.kind == "hf":
        build, family = _hf_model(mc, dc, lora, vocab_size, max_token_id, notes)
        if mc.attention == "varlen":
            build = with_varlen(build)
        if family in MOE_FAMILIES:  # Hugging Face MoE (models/hf_moe.py)
            loss_fn = with_aux_loss(cross_entropy_loss)
    else:
        if not mc.factory:
            raise ConfigError("model.kind = 'custom' needs model.factory = 'module:function' returning "
                              "an nn.Module.")
        factory = import_factory(mc.factory, "model.factory")
        check_call(factory, mc.overrides, "model.overrides", mc.factory)
        build = lambda: _module_from(factory, mc.overrides, mc.factory)  # noqa: E731
    if dc.packed and dc.kind not in ("text", "preference", *RECORD_KINDS):
        raise ConfigError(f"data.pack = true works for data.kind 'text', 'chat' and 'instruct', not {dc.kind!r}.")
    return Workload(name=f"{mc.kind}/{dc.kind}", build_model=build, train_set=train, val_set=val,
                    loss_fn=loss_fn, tokens_per_sample=tokens_per_sample, flops_per_token=flops, family=family,
                    sample_text=sample, notes=notes, token_loss=token_loss,
                    collate_fn=collate_fn)


def _hf_model(mc: ModelConfig, dc: DataConfig, lora: LoraConfig | None, vocab_size: int | None,
              max_token_id: int | None, notes: list[str]) -> tuple[Callable[[], nn.Module], str]:
    """(the builder, the family) of a Hugging Face model, random or pretrained; checked up front.
    What the run's log should say about the model is added to ``notes``."""
    config_src = mc.hf_config
    if mc.pretrained:
        # Reads only config.json and the safetensors headers: a bad folder fails before any rank.
        folder = inspect_pretrained(mc.pretrained)
        own = real_path(folder.path / "config.json")
        if mc.hf_config and real_path(resolve_hf_config(mc.hf_config)) != own:
            raise ConfigError(
                f"model.hf_config = {mc.hf_config!r} and model.pretrained = {mc.pretrained!r} name different "
                "configs; a pretrained model is built from its own config.json. Leave model.hf_config empty.")
        config_src = str(folder.path)
        if folder.adapter is not None:
            notes.append(folder.adapter.describe())
    if not config_src:
        raise ConfigError("model.kind = 'hf' needs model.hf_config (a local config.json path, a folder holding "
                          "one, or a bundled name such as 'llama-tiny' or 'llama-3-8b') or model.pretrained (a "
                          "folder with config.json and safetensors weights).")
    kwargs = dict(mc.overrides)
    config_vocab = read_hf_config(config_src).get("vocab_size")
    # Shakespeare's characters or a tokenizer size the embedding only when the config's own
    # (often padded) vocabulary cannot hold the data's ids: a model's vocabulary is kept, so a
    # pretrained embedding keeps its shape and a named architecture (llama-3-70b) is built as
    # is. Bare token ids never resize it (they are checked below).
    config_holds = isinstance(config_vocab, int) and vocab_size is not None and config_vocab >= vocab_size
    if vocab_size is not None and "vocab_size" not in kwargs and dc.kind in ("shakespeare", "text", *RECORD_KINDS) \
            and not config_holds:
        if mc.pretrained:
            source = f"the tokenizer {dc.tokenizer!r}" if dc.kind != "shakespeare" else "the Shakespeare characters"
            raise ConfigError(
                f"{source} needs a vocabulary of {vocab_size} ids, but the pretrained model "
                f"{mc.pretrained!r} has {config_vocab} embedding rows, and its weights cannot be resized. "
                "Tokenise the data with the model's own tokenizer (data.tokenizer = the model folder).")
        kwargs["vocab_size"] = vocab_size
    model_vocab = kwargs.get("vocab_size", config_vocab)
    if isinstance(model_vocab, int):
        _check_token_ids(max_token_id, model_vocab, dc)
    lora = lora if lora is not None and lora.rank > 0 else None
    if mc.pretrained:
        return (lambda: build_hf_model(pretrained=mc.pretrained, lora=lora, **kwargs)), hf_family(config_src)
    return (lambda: build_hf_model(config_src, **kwargs)), hf_family(config_src)


# Which built-in data kinds each built-in model kind takes (custom models and data: the user's call).
TOKEN_DATA = ("shakespeare", "text", "tokens")
IMAGE_DATA = ("cifar10",)
MODEL_INPUTS = {"gpt": TOKEN_DATA, "hf": TOKEN_DATA, "cnn": IMAGE_DATA}


def _check_model_takes_data(mc: ModelConfig, dc: DataConfig) -> None:
    """ConfigError when a built-in model cannot take a built-in data kind (tokens vs images)."""
    takes = MODEL_INPUTS.get(mc.kind)
    if takes is None or dc.kind not in (*TOKEN_DATA, *IMAGE_DATA) or dc.kind in takes:
        return
    what = "token windows" if dc.kind in TOKEN_DATA else "images"
    raise ConfigError(
        f"model.kind = {mc.kind!r} cannot train on data.kind = {dc.kind!r}, which yields {what}: "
        f"{mc.kind!r} takes data.kind = {' or '.join(repr(k) for k in takes)} (or a custom dataset). "
        "Choose a matching pair, e.g. the recipes gpt-shakespeare or cnn-cifar10.")


def _check_token_ids(max_token_id: int | None, model_vocab: int, dc: DataConfig) -> None:
    """ConfigError when the data holds a token id the model's embedding has no row for."""
    if max_token_id is not None and max_token_id >= model_vocab:
        source = {"text": f"the tokenizer {dc.tokenizer!r}",
                  "chat": f"the tokenizer {dc.tokenizer!r}",
                  "instruct": f"the tokenizer {dc.tokenizer!r}",
                  "shakespeare": f"the character vocabulary of {dc.path or 'Tiny Shakespeare'!r}"}.get(
                      dc.kind, f"the token data {dc.path!r}")
        raise ConfigError(
            f"{source} produces token id {max_token_id}, but the model's vocabulary has {model_vocab} "
            f"entries (ids 0..{model_vocab - 1}). Raise model.overrides.vocab_size to at least "
            f"{max_token_id + 1}, or use the tokenizer the data was made with."
        )


def _text_sampler(tokenizer: Any) -> Callable[[nn.Module, torch.device, int, int], str]:
    def sample(model: nn.Module, device: torch.device, n_tokens: int, seed: int) -> str:
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        prompt = getattr(tokenizer, "sample_prompt", None) or tokenizer.encode("\n")
        start = torch.tensor([prompt], dtype=torch.long, device=device)
        was_training = model.training
        model.eval()
        out = model.generate(start, n_tokens, generator=g)
        model.train(was_training)
        return tokenizer.decode(out[0].tolist())
    return sample
