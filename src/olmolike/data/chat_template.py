"""Chat templates: Jinja2 templates that turn a conversation into the text a chat model reads.

Rendering follows Hugging Face ``transformers`` (``apply_chat_template``) so that a model
fine-tuned here sees exactly the text it will see when served with ``transformers``: a
sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, the ``{% generation %}`` tag, the ``tojson`` filter without HTML escaping, the
globals ``raise_exception``, ``strftime_now`` and ``namespace``, message keys whose value is
``None`` dropped, and the variables ``messages``, ``add_generation_prompt``, ``tools``,
``documents`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).

:meth:`ChatTemplate.assistant_spans` finds which characters of a rendered conversation are
the assistant's, which is what supervised fine-tuning trains on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from ..exceptions import ConfigurationError, DataError

__all__ = [
    "BYTE_CHAT_TEMPLATE",
    "ROLES",
    "SPECIAL_TOKEN_NAMES",
    "ChatTemplate",
    "Message",
    "chat_template_for",
    "check_messages",
]


Message = Mapping[str, Any]

ROLES = ("system", "user", "assistant")
"""The roles a message of a training conversation (SFT, DPO) may have."""

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens ``transformers`` passes to a template by name (those that are set)."""

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The byte tokenizer's template: plain-text role markers (it has no special tokens to spare),
each turn closed by ``<|end|>``, which a fine-tuned model learns to emit when it is done."""


def _compile(source: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with torch
        raise ConfigurationError(
            "chat templates need the 'jinja2' package: pip install jinja2"
        ) from None

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}``: records where the assistant's text is."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.spans: list[tuple[int, int]] | None = None
            self.rendered: list[str] | None = None

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = str(caller())
            if self.spans is not None and self.rendered is not None:
                start = len("".join(self.rendered))
                self.spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigurationError(
            f"the chat template does not parse (line {e.lineno}: {e.message}); fix the template"
        ) from None
    tag = next(ext for ext in env.extensions.values() if isinstance(ext, GenerationTag))
    return template, tag


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template, self._tag = _compile(source)
        self.has_generation_tags = "generation" in source and "endgeneration" in source

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` renders it."""
        return self._render(messages, add_generation_prompt, kwargs)

    def _variables(
        self, messages: Sequence[Message], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        cleaned = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        return {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            **kwargs,
            "messages": cleaned,
            "add_generation_prompt": add_generation_prompt,
        }

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool, kwargs: Any) -> str:
        import jinja2

        variables = self._variables(messages, add_generation_prompt, kwargs)
        try:
            return str(self._template.render(**variables))
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template refused the conversation: {e}") from None

    @contextmanager
    def _tracking(self, chunks: list[str]) -> Iterator[list[tuple[int, int]]]:
        spans: list[tuple[int, int]] = []
        self._tag.spans, self._tag.rendered = spans, chunks
        try:
            yield spans
        finally:
            self._tag.spans = self._tag.rendered = None

    def assistant_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character ranges of the
        assistant's turns: the text a supervised fine-tune trains on.

        A template with ``{% generation %}`` tags marks the ranges itself. Otherwise each
        assistant turn is located by rendering prefixes of the conversation: the turn is what
        ``messages[: i + 1]`` adds to ``messages[:i]`` rendered with the generation prompt,
        so the role header (and whatever the prompt adds) is never trained on while the
        turn's closing marker is. A template whose prefixes are not prefixes of the whole
        (one that rewrites earlier turns) is an error, since then no range is right.
        """
        if self.has_generation_tags:
            return self._tagged_spans(messages)
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self._prefix(messages[:i], full, add_generation_prompt=True))
            end = len(self._prefix(messages[: i + 1], full, add_generation_prompt=False))
            if end > start:
                spans.append((start, end))
        return full, spans

    def _prefix(
        self, messages: Sequence[Message], full: str, *, add_generation_prompt: bool
    ) -> str:
        text = (
            self.render(messages, add_generation_prompt=add_generation_prompt) if messages else ""
        )
        if not full.startswith(text):
            raise DataError(
                "the chat template renders a conversation's first turns differently from the "
                "whole conversation, so the assistant's tokens cannot be located by prefixes; "
                "mark them with {% generation %} ... {% endgeneration %} in the template"
            )
        return text

    def _tagged_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        # The tag reads the length of the chunks generated so far as the span's offset.
        variables = self._variables(messages, False, {})
        chunks: list[str] = []
        import jinja2

        with self._tracking(chunks) as spans:
            try:
                for chunk in self._template.generate(**variables):
                    chunks.append(chunk)
            except jinja2.TemplateError as e:
                raise DataError(f"the chat template refused the conversation: {e}") from None
        return "".join(chunks), spans

    @classmethod
    def from_tokenizer_config(cls, data: Mapping[str, Any], source: str) -> ChatTemplate | None:
        """The template of a parsed ``tokenizer_config.json`` (``None`` if it has none).

        ``chat_template`` is either a string or, in files written for several templates, a list
        of ``{"name", "template"}`` of which the one named ``default`` is used.
        """
        template = data.get("chat_template")
        if template is None:
            return None
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ConfigurationError(
                    f"{source} has named chat templates {sorted(map(str, named))} but none "
                    "called 'default'; name the one to train with 'default'"
                )
            template = named["default"]
        if not isinstance(template, str):
            raise ConfigurationError(f"{source}: chat_template must be a string")
        return cls(template, special_token_strings(data))


def special_token_strings(data: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token`` etc. of a ``tokenizer_config.json``: plain strings or ``AddedToken`` dicts."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = data.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def chat_template_for(own: ChatTemplate | None, path: str | None) -> ChatTemplate:
    """The template to prepare chat data with: the Jinja file at ``path`` if given (keeping the
    tokenizer's special tokens), else the tokenizer's own template ``own``."""
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"no chat template file at {path!r}") from None
        return ChatTemplate(text, own.special_tokens if own is not None else None)
    if own is None:
        raise DataError(
            "the tokenizer has no chat template: put a tokenizer_config.json with a "
            "'chat_template' beside its tokenizer.json, or pass --chat-template FILE.jinja"
        )
    return own


def check_messages(value: Any, where: str, key: str | None = None) -> list[Message]:
    """``value`` as a conversation read from a data file: a non-empty list of objects with a
    known ``role`` and a string ``content``. Otherwise a :class:`DataError` that names
    ``where`` (the file and line) and the record's ``key`` holding the conversation."""
    field = f"'{key}'" if key else "'messages'"
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field} must be a non-empty list of role/content objects")
    of = f"{field} message" if key else "message"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(
                f"{where}: {of} {i} must be an object with a string 'content', got "
                f"{json.dumps(message)[:80]}"
            )
        if message.get("role") not in ROLES:
            raise DataError(
                f"{where}: {of} {i} has the unknown role {message.get('role')!r}; the roles "
                f"are {', '.join(ROLES)}: rename it or remove the message"
            )
    return value
