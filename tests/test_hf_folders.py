"""One reader of Hugging Face model folders: every family in the family list, saved by the installed
transformers, is read by the planner exactly (its parameter count is the model's) in the key
spellings transformers writes, and the spelling table covers transformers' own attribute maps."""

import pytest

transformers = pytest.importorskip("transformers")

from shardwise.core.families import HF_FAMILIES, MOE_FAMILIES  # noqa: E402
from shardwise.models.hf_config import KEY_SPELLINGS, read_hf_config  # noqa: E402
from shardwise.plan.finetune import pretrained_spec  # noqa: E402

DENSE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
EXTRA = {"qwen2_moe": {"shared_expert_intermediate_size": 40}}


def _kwargs(family: str) -> dict:
    if family == "gpt2":
        return {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "max_position_embeddings": 128}
    return {**DENSE, **(MOE if family in MOE_FAMILIES else {}), **EXTRA.get(family, {})}


def save_family(folder, family: str) -> int:
    """A randomly initialised 2-layer model of ``family`` saved by transformers; its parameter count."""
    import torch

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(family, **_kwargs(family))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_the_planner_reads_every_family_as_transformers_saves_it(tmp_path, family):
    n_params = save_family(tmp_path / family, family)
    raw = read_hf_config(tmp_path / family)
    assert raw["model_type"] == family
    spec = pretrained_spec(str(tmp_path / family))  # what `plan --pretrained DIR` reads
    assert spec.n_params == n_params
    assert spec.family == family and spec.max_seq == 128 and spec.n_layers == 2
    if family in MOE_FAMILIES:
        assert spec.moe is not None and spec.moe.n_experts == 4 and spec.moe.top_k == 2


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_every_spelling_transformers_maps_is_in_the_table(family):
    attribute_map = transformers.AutoConfig.for_model(family).attribute_map
    for a, b in attribute_map.items():
        assert any({a, b} <= set(spellings) for spellings in KEY_SPELLINGS.values()), (family, a, b)
