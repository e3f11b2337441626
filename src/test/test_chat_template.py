"""Chat templates render and tokenize exactly as transformers' apply_chat_template does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olmolike.data import ByteTokenizer, ChatTemplate, TokenizerConfig, apply_chat_template
from olmolike.data.sft import tokenize_example
from olmolike.exceptions import ConfigurationError, DataError

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# Written for these tests in the style of Llama 3's: a BOS, headers, content trimmed, a system
# default, and an error for a conversation whose roles do not alternate.
LLAMA3_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "You are helpful." %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('roles must alternate user/assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with the assistant's turns marked by {% generation %}, and tojson of a message's
# metadata (exercising transformers' tojson filter, which does not escape HTML).
CHATML_TAGGED = """{% for message in messages %}
{% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}<|im_end|>
{% endgeneration %}
{% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if message.meta is defined %} {{ message.meta | tojson }}{% endif %}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [
        {"role": "system", "content": "  Answer in one word. "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "And <b>3+3</b>, in Français?"},
        {"role": "assistant", "content": "six - ça fait six"},
    ],
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a+b"}],
]
CORPUS = ["what is two plus two? four. and three plus three: six. def add(a, b): return a + b"]


def hf_folder(tmp_path: Path, specials: list[str], config: dict[str, object]) -> Path:
    """A byte-level BPE tokenizer trained here, with a tokenizer_config.json beside it."""
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(CORPUS * 4, trainer)
    model.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def llama3(tmp_path: Path) -> Path:
    config = {
        "chat_template": LLAMA3_STYLE,
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "__type": "AddedToken", "special": True},
    }
    return hf_folder(tmp_path, LLAMA3_SPECIALS, config)


@pytest.fixture
def chatml(tmp_path: Path) -> Path:
    # The list form of tokenizer_config's chat_template: named templates, "default" is used.
    templates = [{"name": "default", "template": CHATML_TAGGED}, {"name": "other", "template": ""}]
    config = {"chat_template": templates, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return hf_folder(tmp_path, CHATML_SPECIALS, config)


@pytest.mark.parametrize("template", ["llama3", "chatml"])
def test_rendering_and_tokens_match_transformers(
    template: str, request: pytest.FixtureRequest
) -> None:
    folder = request.getfixturevalue(template)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = TokenizerConfig(identifier=str(folder / "tokenizer.json")).build()
    assert ours.chat_template is not None
    for messages in CONVERSATIONS:
        for prefix in range(1, len(messages) + 1):
            for generation in (False, True):
                turns = messages[:prefix]
                kwargs = {"add_generation_prompt": generation}
                want_text = hf.apply_chat_template(turns, tokenize=False, **kwargs)
                assert ours.chat_template.render(turns, **kwargs) == want_text
                want_ids = hf.apply_chat_template(turns, return_dict=False, **kwargs)
                assert apply_chat_template(ours, turns, **kwargs) == want_ids
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert ours.pad_token_id == (
        hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    )


def test_generation_tags_give_the_same_mask_as_transformers(chatml: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(chatml))
    ours = TokenizerConfig(identifier=str(chatml / "tokenizer.json")).build()
    assert ours.chat_template is not None and ours.chat_template.has_generation_tags
    for messages in CONVERSATIONS:
        out = hf.apply_chat_template(messages, return_assistant_tokens_mask=True)
        example = tokenize_example(ours, ours.chat_template, messages)
        assert example.ids.tolist() == out["input_ids"]
        want = list(out["assistant_masks"])
        want[0] = 0  # the first token is never a target: nothing precedes it
        assert example.trained.astype(int).tolist() == want


def test_prefix_rendering_finds_the_same_tokens_as_generation_tags(chatml: Path) -> None:
    """Without tags, the assistant turns are located by rendering prefixes: same tokens."""
    tagged = TokenizerConfig(identifier=str(chatml / "tokenizer.json")).build()
    assert tagged.chat_template is not None
    untagged = ChatTemplate(
        CHATML_TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}\n", ""),
        tagged.chat_template.special_tokens,
    )
    for messages in CONVERSATIONS:
        a = tokenize_example(tagged, tagged.chat_template, messages)
        b = tokenize_example(tagged, untagged, messages)
        assert a.ids.tolist() == b.ids.tolist()
        assert a.trained.tolist() == b.trained.tolist()


def test_multi_turn_masks_cover_exactly_the_assistant_turns(llama3: Path) -> None:
    ours = TokenizerConfig(identifier=str(llama3 / "tokenizer.json")).build()
    assert ours.chat_template is not None
    messages = CONVERSATIONS[0]
    example = tokenize_example(ours, ours.chat_template, messages)
    trained = ours.decode(example.ids[example.trained].tolist())
    # <|eot_id|> is special and skipped by decode; the two answers, trimmed, remain.
    assert trained == "foursix - ça fait six"
    runs = (example.trained[1:] & ~example.trained[:-1]).sum()
    assert runs == 2  # two separate assistant turns, the user turn between them untrained


def test_byte_tokenizer_has_a_default_template() -> None:
    tok = ByteTokenizer()
    text = tok.chat_template.render(CONVERSATIONS[1], add_generation_prompt=False)
    assert text == "<|user|>\ndef add(a, b):<|end|>\n<|assistant|>\nreturn a+b<|end|>\n"
    prompt = tok.chat_template.render(CONVERSATIONS[1][:1], add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>\n")
    example = tokenize_example(tok, tok.chat_template, CONVERSATIONS[1])
    assert tok.decode(example.ids[example.trained].tolist()) == "return a+b<|end|>\n"


def test_template_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    strict = ChatTemplate("{{ raise_exception('no system turns') }}")
    with pytest.raises(DataError, match="no system turns"):
        strict.render(CONVERSATIONS[1])
    rewriting = ChatTemplate(
        "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(DataError, match="generation"):
        rewriting.assistant_spans(CONVERSATIONS[1])
    no_default = [{"name": "tool_use", "template": "x"}]
    with pytest.raises(ConfigurationError, match="default"):
        ChatTemplate.from_tokenizer_config({"chat_template": no_default}, "tokenizer_config.json")


def test_a_chat_template_jinja_file_is_found(tmp_path: Path) -> None:
    hf_folder(tmp_path, CHATML_SPECIALS, {"eos_token": "<|im_end|>"})
    tok = TokenizerConfig(identifier=str(tmp_path / "tokenizer.json")).build()
    assert tok.chat_template is None
    with pytest.raises(ConfigurationError, match="no chat template"):
        apply_chat_template(tok, CONVERSATIONS[1])
    (tmp_path / "chat_template.jinja").write_text(CHATML_TAGGED)
    tok = TokenizerConfig(identifier=str(tmp_path / "tokenizer.json")).build()
    assert tok.chat_template is not None and tok.chat_template.source == CHATML_TAGGED
