"""Tokenizers: the byte tokenizer, tokenizer files (built in the test) and TokenizerConfig."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from olmolike.data import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig
from olmolike.exceptions import ConfigurationError

tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the cat sat on the mat", "the dog ate the cat food", "a mat for a dog"]


def word_level_file(tmp_path: Path, specials: list[str]) -> Path:
    """A word-level tokenizer trained on a few strings, saved as a tokenizer JSON file."""
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", *specials])
    model.train_from_iterator(CORPUS, trainer)
    path = tmp_path / "tokenizer.json"
    model.save(str(path))
    return path


def test_byte_tokenizer_round_trips_utf8_without_specials_unless_asked() -> None:
    tok = ByteTokenizer()
    text = "héllo, 世界"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=True) == [*ids, ByteTokenizer.EOS]
    assert tok.decode([*ids, ByteTokenizer.EOS, ByteTokenizer.PAD]) == text
    assert tok.encode_batch(["a", "bc"]) == [[97], [98, 99]]
    assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (
        258,
        256,
        257,
        None,
    )
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_array_path_is_a_view_of_the_bytes() -> None:
    text = "tokens " * 1000
    array = ByteTokenizer().encode_to_array(text)
    assert array.dtype == np.uint8 and not array.flags.owndata  # np.frombuffer, no copy
    assert array.tolist() == ByteTokenizer().encode(text)


def test_byte_decode_replaces_broken_utf8_and_rejects_unknown_ids() -> None:
    tok = ByteTokenizer()
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a truncated 3-byte character
    with pytest.raises(ValueError, match="258"):
        tok.decode([258])


def test_byte_config_resolves_fixed_ids_and_pads_the_vocabulary() -> None:
    resolved = TokenizerConfig().resolve()
    assert (resolved.eos_token_id, resolved.pad_token_id, resolved.vocab_size) == (256, 257, 258)
    assert TokenizerConfig().padded_vocab_size() == 384
    assert TokenizerConfig().padded_vocab_size(64) == 320
    assert TokenizerConfig(vocab_size=512).padded_vocab_size() == 512
    assert TokenizerConfig.from_dict(resolved.as_config_dict()) == resolved
    with pytest.raises(ConfigurationError, match=r"eos_token_id.*fixed at 256"):
        TokenizerConfig(eos_token_id=0)
    with pytest.raises(ConfigurationError, match="at least 258"):
        TokenizerConfig(vocab_size=100)


def test_tokenizer_file_resolves_special_ids_by_name(tmp_path: Path) -> None:
    path = word_level_file(tmp_path, ["<|endoftext|>", "<pad>"])
    config = TokenizerConfig(identifier=str(path))
    tok = config.build()
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    raw = tokenizers.Tokenizer.from_file(str(path))
    assert tok.eos_token_id == raw.token_to_id("<|endoftext|>")
    assert tok.pad_token_id == raw.token_to_id("<pad>")
    assert tok.bos_token_id is None
    ids = tok.encode("the cat sat")
    assert tok.encode("the cat sat", add_special_tokens=True) == [*ids, tok.eos_token_id]
    assert tok.decode([*ids, tok.eos_token_id]) == "the cat sat"
    assert tok.encode_to_array("the cat sat").tolist() == ids
    assert tok.encode_batch(["the cat", "a dog"]) == [tok.encode("the cat"), tok.encode("a dog")]
    resolved = config.resolve()
    assert resolved.vocab_size == raw.get_vocab_size() and resolved.eos_token_id == tok.eos_token_id


def test_tokenizer_file_without_eos_needs_an_explicit_id(tmp_path: Path) -> None:
    path = word_level_file(tmp_path, [])
    with pytest.raises(ConfigurationError, match="eos_token_id"):
        TokenizerConfig(identifier=str(path)).build()
    tok = TokenizerConfig(identifier=str(path), eos_token_id=0).build()
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0  # pad falls back to EOS


def test_tokenizer_file_errors_name_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError, match="no tokenizer file"):
        TokenizerConfig(identifier=str(tmp_path / "missing.json")).build()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="not a valid"):
        TokenizerConfig(identifier=str(tmp_path / "bad.json")).build()
    path = word_level_file(tmp_path, ["<|endoftext|>"])
    with pytest.raises(ConfigurationError, match="raise vocab_size"):
        TokenizerConfig(identifier=str(path), vocab_size=3).build()
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'olmolike\[hf\]'"):
        TokenizerConfig(identifier=str(path)).build()
