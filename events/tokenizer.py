"""Tokenizers shared by workers and routers, so both turn the same text into the same ids.

The default is byte-level: each UTF-8 byte of the text is one token id (0-255), followed
by two special ids (end of sequence, beginning of sequence) that encoding never emits.
A Hugging Face tokenizer can be used instead through the optional ``tokenizers``
library (``pip install 'kvroute[tokenizers]'``): a ``tokenizer.json`` file, or a model
directory holding one (its ``tokenizer_config.json`` then names the end-of-sequence token,
and :mod:`events.chat_template` finds the model's chat template there).

Special tokens follow vLLM's serving defaults: a completion's text prompt is encoded with
them (``add_special_tokens=True``: the tokenizer's post-processor adds e.g. a BOS token),
a rendered chat prompt without (its template writes them itself).

NOTE: a router computes prefix keys from the ids its tokenizer produces, so a worker and
the routers in front of it must load the same tokenizer or no prefix will ever match.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

from events.errors import EventsError

__all__ = [
    "BYTE_BOS_ID",
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_file",
]

BYTE_EOS_ID: Final = 256
"""End-of-sequence id of the byte-level tokenizer."""
BYTE_BOS_ID: Final = 257
"""Beginning-of-sequence id of the byte-level tokenizer (reserved; never emitted)."""
BYTE_VOCAB_SIZE: Final = 258
"""256 byte ids plus the two specials."""


class TokenizerError(EventsError, ValueError):
    """A tokenizer could not be loaded or could not encode its input."""


@runtime_checkable
class Tokenizer(Protocol):
    """Turns text into token ids and back."""

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (every id is below it)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, or ``None`` when the vocabulary has none."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, those the tokenizer's
        post-processor adds (a BOS token, for many models)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; special ids are skipped, broken UTF-8 becomes U+FFFD."""
        ...


class ByteTokenizer:
    """Byte-level tokenizer: one id per UTF-8 byte, plus EOS and BOS specials."""

    @property
    def vocab_size(self) -> int:
        """Always :data:`BYTE_VOCAB_SIZE`."""
        return BYTE_VOCAB_SIZE

    @property
    def eos_token_id(self) -> int:
        """Always :data:`BYTE_EOS_ID`."""
        return BYTE_EOS_ID

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids (no special token is ever added)."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Bytes of the ids below 256, decoded as UTF-8 with replacement."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library.

    Args:
        path: Path of the ``tokenizer.json`` file.
        eos_token: Name of the end-of-sequence token to look up; the first of a few
            common names that exists is used when ``None``.

    Raises:
        TokenizerError: ``tokenizers`` is not installed or the file cannot be loaded.
    """

    _EOS_CANDIDATES: Final = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise TokenizerError(
                "--tokenizer needs the 'tokenizers' library: pip install 'kvroute[tokenizers]'"
            ) from exc
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise TokenizerError(f"cannot load tokenizer file {str(path)!r}: {exc}") from exc
        names = (eos_token,) if eos_token is not None else self._EOS_CANDIDATES
        ids = [self._tok.token_to_id(name) for name in names]
        self._eos: int | None = next((i for i in ids if i is not None), None)
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary, added tokens included."""
        return self._vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """The id of the end-of-sequence token, if the vocabulary has one."""
        return self._eos

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, with the post-processor's special tokens if asked."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one in a directory.

    Raises:
        TokenizerError: Neither exists.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"no tokenizer at {str(path)!r}: give a tokenizer.json file or a model "
            "directory that holds one"
        )
    return path


def _configured_eos(path: Path) -> str | None:
    """The ``eos_token`` of the ``tokenizer_config.json`` beside a ``tokenizer.json``."""
    try:
        config = json.loads((path.parent / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # an AddedToken: {"content": "</s>", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer named on a command line.

    Args:
        path: A ``tokenizer.json`` file, a model directory holding one (its
            ``tokenizer_config.json`` names the end-of-sequence token), or ``None`` for
            the byte-level default.

    Returns:
        The tokenizer.

    Raises:
        TokenizerError: The file cannot be found or loaded.
    """
    if path is None:
        return ByteTokenizer()
    file = tokenizer_file(path)
    return HFTokenizer(file, _configured_eos(file))
