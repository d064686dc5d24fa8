"""Response-only labels under the chat templates of the model families users fine-tune, token by
token: the trained tokens are exactly each assistant turn's text (its content as the template
writes it, and its end-of-turn marker), every other token is not trained.

The templates are the models' own (``chat_template`` of their tokenizer_config.json; tool-call
branches, which these records never reach, left out of the longer ones), on a tiny tokenizer made
here with the family's special tokens: byte-level BPE (Llama 3, Qwen3, Gemma) or a
sentencepiece-style "▁" tokenizer (Llama 2, Mistral, Phi-3), whose tokens carry the space before
the assistant's first word. None of them marks ``{% generation %}`` blocks; the spans come from
renderings of the record (``shardwise.data.template_spans``); a template with the markers uses
them (the last case)."""

import pytest

pytest.importorskip("transformers")

from shardwise.core.config import DataConfig  # noqa: E402
from shardwise.data.instruct import IGNORE_INDEX, RecordRenderer  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from tests.helpers.text import corpus_text  # noqa: E402

LLAMA3 = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA2 = (  # meta-llama/Llama-2-7b-chat-hf: BOS before every user turn, system folded into the first
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

MISTRAL = (  # mistralai/Mistral-7B-Instruct-v0.3: the system prompt goes into the LAST user turn
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception('After the optional system "
    "message, conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}{%- else %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token}}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}{%- endif %}{%- endfor %}")

GEMMA = (  # google/gemma-2-2b-it
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

PHI3 = (  # microsoft/Phi-3-mini-4k-instruct: a conversation without the generation prompt ends with EOS
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

QWEN3 = (  # Qwen/Qwen3-8B (tool branches left out): <think> blocks kept only after the last user turn
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")

CHATML_MARKED = (  # ChatML with {% generation %} blocks (as SmolLM3's template writes them)
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
    "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
            "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# family: (template, BPE style, bos, eos)
FAMILIES = {
    "llama3": (LLAMA3, "bytes", "<|begin_of_text|>", "<|eot_id|>"),
    "llama2": (LLAMA2, "spm", "<s>", "</s>"),
    "mistral": (MISTRAL, "spm", "<s>", "</s>"),
    "gemma": (GEMMA, "bytes", "<bos>", "<eos>"),
    "phi3": (PHI3, "spm", "<s>", "<|endoftext|>"),
    "qwen3": (QWEN3, "bytes", None, "<|im_end|>"),
    "chatml-generation": (CHATML_MARKED, "bytes", None, "<|im_end|>"),
}

TURNS = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."},
         {"role": "user", "content": "And three plus three?"}, {"role": "assistant", "content": "Six, my lord."}]
SYSTEM = {"role": "system", "content": "You answer briefly."}

# The text each assistant turn trains on (a leading space may sit in the first token: see _runs).
EXPECTED = {
    "llama3": ["It is four.<|eot_id|>", "Six, my lord.<|eot_id|>"],
    "llama2": [" It is four. </s>", " Six, my lord. </s>"],
    "mistral": [" It is four.</s>", " Six, my lord.</s>"],
    "gemma": ["It is four.<end_of_turn>\n", "Six, my lord.<end_of_turn>\n"],
    # The last turn's EOS is the conversation's end, which the model must learn to produce.
    "phi3": ["It is four.<|end|>\n", "Six, my lord.<|end|>\n<|endoftext|>"],
    # The last turn (after the last user message) gets the template's empty think block; the
    # earlier one is rendered without it, as at inference.
    "qwen3": ["It is four.<|im_end|>\n", "<think>\n\n</think>\n\nSix, my lord.<|im_end|>\n"],
    "chatml-generation": ["It is four.<|im_end|>", "Six, my lord.<|im_end|>"],
}


@pytest.fixture(scope="module")
def tokenizers():
    """Two tiny fast tokenizers with every family's special tokens: byte-level and "▁" style."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    out = {}
    for style in ("bytes", "spm"):
        tok = Tokenizer(models.BPE())
        if style == "bytes":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
        else:  # as Llama 2 / Mistral / Phi-3's tokenizer.json: spaces become "▁", a token starts with one
            tok.normalizer = normalizers.Replace(" ", "▁")
            tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
            tok.decoder = decoders.Replace("▁", " ")
            alphabet = []
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                      show_progress=False)
        tok.train_from_iterator([corpus_text(20000) + " <think>\n</think>\n\n"], trainer)
        out[style] = tok
    return out


def _renderer(tokenizers, family: str, **data) -> RecordRenderer:
    from transformers import PreTrainedTokenizerFast

    template, style, bos, eos = FAMILIES[family]
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers[style], bos_token=bos, eos_token=eos,
                                  chat_template=template)
    return RecordRenderer(tok, DataConfig(kind=data.pop("kind", "chat"), tokenizer="tiny", **data))


def _runs(r: RecordRenderer, record: dict) -> tuple[list[str], str, int]:
    """The text of each run of consecutive trained tokens (from the tokens' own character offsets in
    the rendered record), the rendered record, and the number of tokens."""
    ids, labels = r.encode(record, "rec")
    full = r._render(r.messages(record, "rec"), False)
    enc = r.tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids.tolist()  # the ids are the rendered text's
    assert ((labels == ids) | (labels == IGNORE_INDEX)).all()
    runs: list[list[int]] = []
    for k, trained in enumerate(labels != IGNORE_INDEX):
        if trained:
            if runs and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
    offsets = enc["offset_mapping"]
    return [full[offsets[run[0]][0]:offsets[run[-1]][1]] for run in runs], full, len(ids)


def _same(got: list[str], want: list[str]) -> bool:
    # A "▁" tokenizer's first content token carries the space before it; its offsets may or may not.
    return [g.lstrip(" ") for g in got] == [w.lstrip(" ") for w in want] and all(
        g == w or g == w.lstrip(" ") for g, w in zip(got, want))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_labels_cover_exactly_the_assistant_turns(tokenizers, family):
    r = _renderer(tokenizers, family)
    # One turn, and two (the second a case where the first turn's rendering changes once later
    # turns follow: Phi-3's trailing EOS, Qwen3's dropped think block).
    for turns, want in ((TURNS[:2], EXPECTED[family][:1]), (TURNS, EXPECTED[family])):
        if family == "phi3" and len(turns) == 2:
            want = ["It is four.<|end|>\n<|endoftext|>"]
        if family == "qwen3" and len(turns) == 2:
            want = ["<think>\n\n</think>\n\nIt is four.<|im_end|>\n"]
        got, full, _ = _runs(r, {"messages": turns})
        assert _same(got, want), (family, got, want, full)
        # Everything else is prompt: the user turns' text is never trained.
        assert all("two plus two" not in g and "three plus three" not in g for g in got)


@pytest.mark.parametrize("family", ["llama3", "llama2", "mistral", "phi3", "qwen3"])
def test_a_system_prompt_is_never_trained(tokenizers, family):
    r = _renderer(tokenizers, family)
    got, full, _ = _runs(r, {"messages": [SYSTEM, *TURNS]})
    assert _same(got, EXPECTED[family]), (family, got, full)
    if family != "mistral":  # Mistral v0.3 writes the system prompt only into a final user turn
        assert "You answer briefly." in full


def test_qwen3_reasoning_is_trained_where_the_template_keeps_it(tokenizers):
    r = _renderer(tokenizers, "qwen3")
    think = [dict(TURNS[1], content="<think>\nadd them\n</think>\n\nIt is four."), TURNS[2],
             dict(TURNS[3], content="<think>\nsix\n</think>\n\nSix, my lord.")]
    got, full, _ = _runs(r, {"messages": [TURNS[0], *think]})
    # The first answer's reasoning is dropped by the template (history); the last one's is kept.
    assert "add them" not in full
    assert got == ["It is four.<|im_end|>\n", "<think>\nsix\n</think>\n\nSix, my lord.<|im_end|>\n"]


def test_instruct_records_and_bos_without_a_template(tokenizers):
    # Under a template: one user turn and one assistant turn.
    r = _renderer(tokenizers, "llama3", kind="instruct")
    got, full, _ = _runs(r, {"prompt": "What is two plus two?", "response": "It is four."})
    assert got == ["It is four.<|eot_id|>"] and full.startswith("<|begin_of_text|>")
    # Without one: prompt + response + EOS, after the BOS the tokenizer adds itself (a Llama-style
    # post-processor); the BOS and the prompt are not trained.
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    base = tokenizers["spm"]
    bos_id = base.token_to_id("<s>")
    base.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    try:
        tok = PreTrainedTokenizerFast(tokenizer_object=base, bos_token="<s>", eos_token="</s>")
        plain = RecordRenderer(tok, DataConfig(kind="instruct", tokenizer="tiny"))
        ids, labels = plain.encode({"prompt": "What is two plus two?", "response": "It is four."}, "rec")
    finally:
        base.post_processor = None
    assert ids[0] == bos_id and (ids == bos_id).sum() == 1
    trained = ids[labels != IGNORE_INDEX]
    assert tok.decode(trained.tolist()).strip() == "It is four.</s>"
    assert labels[0] == IGNORE_INDEX


def test_templates_that_cannot_be_supported_are_refused(tokenizers):
    # Gemma has no system role: the template's own error, naming the record.
    with pytest.raises(ConfigError, match="rec: the chat template fails on this record: .*System role not supported"):
        _renderer(tokenizers, "gemma").encode({"messages": [SYSTEM, *TURNS]}, "rec")
    # A template that keeps only the last answer: the first answer is rendered in no place.
    r = _renderer(tokenizers, "llama3")
    r.tok.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|start_header_id|>"
                           "{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
                           "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                           "{% endif %}")
    with pytest.raises(ConfigError, match="rec: the chat template renders no assistant span for turn 1: the "
                                          "template does not render the turn's content once"):
        r.encode({"messages": TURNS}, "rec")
