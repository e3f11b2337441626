"""Tokenizers: the embedded byte tokenizer, and Hugging Face ``tokenizers`` JSON files.

The byte tokenizer needs no download and no extra package, so the default pipeline (prepare
the data, train on it) works on a machine with no network. A Hugging Face tokenizer file is
supported through the optional ``tokenizers`` package (``pip install 'olmolike[hf]'``).

Both implement :class:`Tokenizer`. Special tokens are never added unless asked for, because
``prepare-data`` decides itself where documents end (one EOS after each document).

Each tokenizer may carry a :class:`~olmolike.data.chat_template.ChatTemplate`: the byte
tokenizer a simple built-in one, a tokenizer file the ``chat_template`` of the
``tokenizer_config.json`` (or ``chat_template.jinja``) beside it, whose special tokens
(``eos_token``, ``bos_token``, ``pad_token``) also name the ids, as in ``transformers``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..config import Config
from ..exceptions import ConfigurationError
from ..io import exists, join_path, read_bytes
from .chat_template import BYTE_CHAT_TEMPLATE, ChatTemplate, Message, special_token_strings

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerConfig", "apply_chat_template"]


BYTE_IDENTIFIER = "byte"

# Looked up in a tokenizer file's vocabulary when the config does not name the id itself.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_PAD_CANDIDATES = ("<|padding|>", "<pad>", "<|pad|>", "[PAD]")
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[CLS]")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS (if any) first, EOS last."""
        ...

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]: ...

    def encode_to_array(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no special tokens) as a 1-D unsigned integer array."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping special tokens."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens) and the character where each one starts."""
        ...

    @property
    def chat_template(self) -> ChatTemplate | None:
        """How a conversation becomes text, or ``None`` if the tokenizer has no template."""
        ...


def apply_chat_template(
    tokenizer: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of a conversation, as ``transformers``' ``apply_chat_template`` makes them:
    the rendered text encoded without adding special tokens (the template writes its own)."""
    template = tokenizer.chat_template
    if template is None:
        raise ConfigurationError(
            "the tokenizer has no chat template; put a tokenizer_config.json with a "
            "'chat_template' (or a chat_template.jinja) beside its tokenizer.json"
        )
    return tokenizer.encode(template.render(messages, add_generation_prompt=add_generation_prompt))


def _with_specials(ids: list[int], bos: int | None, eos: int) -> list[int]:
    return ([bos] if bos is not None else []) + ids + [eos]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is EOS, 257 is PAD (vocabulary 258).

    There is no BOS token: documents are separated by EOS alone.
    """

    EOS = 256
    PAD = 257
    VOCAB_SIZE = 258
    _template: ChatTemplate | None = None

    @property
    def chat_template(self) -> ChatTemplate:
        """:data:`~olmolike.data.chat_template.BYTE_CHAT_TEMPLATE`, compiled once."""
        if ByteTokenizer._template is None:
            ByteTokenizer._template = ChatTemplate(BYTE_CHAT_TEMPLATE)
        return ByteTokenizer._template

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        starts: list[int] = []
        for position, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids += encoded
            starts += [position] * len(encoded)
        return ids, starts

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    @property
    def bos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return _with_specials(ids, None, self.EOS) if add_special_tokens else ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def encode_to_array(self, text: str) -> np.ndarray:
        # A view of the encoded bytes: no per-token Python work, so tens of MB take ~10 ms.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        data = bytearray()
        for i in ids:
            token = int(i)
            if not 0 <= token < self.VOCAB_SIZE:
                raise ValueError(f"token id {token} is outside the byte vocabulary [0, 258)")
            if token < 256:
                data.append(token)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with resolved special-token ids."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_id: int,
        pad_token_id: int,
        bos_token_id: int | None,
        vocab_size: int,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._eos = eos_token_id
        self._pad = pad_token_id
        self._bos = bos_token_id
        self._vocab_size = vocab_size
        self._special = {i for i in (eos_token_id, pad_token_id, bos_token_id) if i is not None}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return _with_specials(ids, self._bos, self._eos) if add_special_tokens else ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        out = [list(e.ids) for e in encodings]
        if add_special_tokens:
            out = [_with_specials(ids, self._bos, self._eos) for ids in out]
        return out

    def encode_to_array(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [start for start, _ in encoding.offsets]

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._chat_template

    def decode(self, ids: Iterable[int]) -> str:
        kept = [int(i) for i in ids if int(i) not in self._special]
        return str(self._tokenizer.decode(kept, skip_special_tokens=True))


def _load_hf_tokenizer(identifier: str) -> Any:
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError:
        raise ConfigurationError(
            f"reading the tokenizer file {identifier!r} needs the 'tokenizers' package; "
            "install it with: pip install 'olmolike[hf]' (or use identifier='byte')",
            path="identifier",
        ) from None
    try:
        text = read_bytes(identifier).decode("utf-8")
    except FileNotFoundError:
        raise ConfigurationError(
            f"no tokenizer file at {identifier!r}; give the path of a Hugging Face tokenizer "
            "JSON file (tokenizer.json) or 'byte' for the embedded byte tokenizer",
            path="identifier",
        ) from None
    try:
        return RawTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ConfigurationError(
            f"{identifier!r} is not a valid Hugging Face tokenizer JSON file: {e}",
            path="identifier",
        ) from None


def _read_tokenizer_config(identifier: str) -> tuple[ChatTemplate | None, dict[str, str]]:
    """The chat template and special-token strings of the ``tokenizer_config.json`` (and
    ``chat_template.jinja``, which newer ``transformers`` versions write) beside the file."""
    folder = identifier.rstrip("/").rpartition("/")[0] or "."
    config_path = join_path(folder, "tokenizer_config.json")
    data: dict[str, Any] = {}
    if exists(config_path):
        try:
            data = json.loads(read_bytes(config_path))
        except json.JSONDecodeError as e:
            raise ConfigurationError(f"{config_path} is not valid JSON: {e}") from None
    template = ChatTemplate.from_tokenizer_config(data, config_path)
    jinja_path = join_path(folder, "chat_template.jinja")
    if template is None and exists(jinja_path):
        template = ChatTemplate(read_bytes(jinja_path).decode("utf-8"), special_token_strings(data))
    return template, special_token_strings(data)


def _find_token(tokenizer: Any, candidates: Sequence[str]) -> int | None:
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None


@dataclass
class TokenizerConfig(Config):
    """Which tokenizer turns text into token ids, and its special-token ids.

    ``identifier`` is ``"byte"`` (the embedded :class:`ByteTokenizer`) or the path or URL of a
    Hugging Face ``tokenizers`` JSON file. Ids left as ``None`` are resolved from the tokenizer
    (see :meth:`resolve`); for a tokenizer file, by looking up common names such as
    ``<|endoftext|>`` and ``</s>``.
    """

    identifier: str = BYTE_IDENTIFIER
    """``byte`` (the embedded byte tokenizer: 256 byte ids, EOS and padding) or the path or URL of a
    Hugging Face ``tokenizers`` JSON file."""
    eos_token_id: int | None = None
    """Appended after every document; required if the tokenizer file has no known EOS token."""
    pad_token_id: int | None = None
    """Defaults to the tokenizer's pad token, else to the EOS token."""
    bos_token_id: int | None = None
    """The id that begins a sequence, where the tokenizer or its chat template uses one; ``None``:
    the tokenizer file's own, if it names one (the byte tokenizer has none)."""
    vocab_size: int | None = None
    """Rows of the model's vocabulary; at least the tokenizer's (default: exactly that)."""

    def validate(self) -> None:
        if not self.identifier:
            raise self._invalid("identifier", "must be 'byte' or the path of a tokenizer file")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise self._invalid("vocab_size", f"must be positive, got {self.vocab_size}")
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 0 or (self.vocab_size is not None and value >= self.vocab_size):
                raise self._invalid(name, f"must be in [0, vocab_size), got {value}")
        if self.identifier == BYTE_IDENTIFIER:
            self._validate_byte_ids()

    def _validate_byte_ids(self) -> None:
        fixed = {
            "eos_token_id": ByteTokenizer.EOS,
            "pad_token_id": ByteTokenizer.PAD,
            "bos_token_id": None,
        }
        for name, expected in fixed.items():
            value = getattr(self, name)
            if value is not None and value != expected:
                raise self._invalid(
                    name,
                    f"the byte tokenizer's {name} is fixed at {expected}; leave it unset",
                )
        if self.vocab_size is not None and self.vocab_size < ByteTokenizer.VOCAB_SIZE:
            raise self._invalid(
                "vocab_size",
                f"the byte tokenizer needs at least {ByteTokenizer.VOCAB_SIZE} ids, "
                f"got {self.vocab_size}",
            )

    def build(self) -> Tokenizer:
        """Load the tokenizer, with every special-token id resolved."""
        if self.identifier == BYTE_IDENTIFIER:
            return ByteTokenizer()
        raw = _load_hf_tokenizer(self.identifier)
        template, named = _read_tokenizer_config(self.identifier)
        own_vocab = int(raw.get_vocab_size(with_added_tokens=True))
        vocab_size = self.vocab_size if self.vocab_size is not None else own_vocab
        if vocab_size < own_vocab:
            raise self._invalid(
                "vocab_size",
                f"the tokenizer {self.identifier!r} has {own_vocab} tokens, more than "
                f"vocab_size={vocab_size}; raise vocab_size or leave it unset",
            )
        eos = (
            self.eos_token_id
            if self.eos_token_id is not None
            else _find_token(raw, (named.get("eos_token", ""), *_EOS_CANDIDATES))
        )
        if eos is None:
            raise self._invalid(
                "eos_token_id",
                f"the tokenizer {self.identifier!r} has none of the usual end-of-text tokens "
                f"({', '.join(_EOS_CANDIDATES)}); set eos_token_id to the id that separates "
                "documents",
            )
        pad = (
            self.pad_token_id
            if self.pad_token_id is not None
            else _find_token(raw, (named.get("pad_token", ""), *_PAD_CANDIDATES))
        )
        bos = (
            self.bos_token_id
            if self.bos_token_id is not None
            else _find_token(raw, (named.get("bos_token", ""), *_BOS_CANDIDATES))
        )
        for name, value in (("eos_token_id", eos), ("pad_token_id", pad), ("bos_token_id", bos)):
            if value is not None and value >= vocab_size:
                raise self._invalid(name, f"{value} is not below vocab_size={vocab_size}")
        return HFTokenizer(
            raw,
            eos_token_id=eos,
            pad_token_id=eos if pad is None else pad,
            bos_token_id=bos,
            vocab_size=vocab_size,
            chat_template=template,
        )

    def resolve(self) -> TokenizerConfig:
        """A copy with every id and ``vocab_size`` filled in from the tokenizer."""
        tokenizer = self.build()
        vocab_size = self.vocab_size if self.vocab_size is not None else tokenizer.vocab_size
        return self.replace(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            vocab_size=vocab_size,
        )

    def padded_vocab_size(self, multiple: int = 128) -> int:
        """``vocab_size`` rounded up to ``multiple``: embedding rows that keep matmuls fast."""
        if multiple <= 0:
            raise ConfigurationError(f"multiple must be positive, got {multiple}")
        vocab_size = self.resolve().vocab_size
        assert vocab_size is not None
        return -(-vocab_size // multiple) * multiple
