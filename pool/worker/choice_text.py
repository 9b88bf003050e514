"""One choice's text as its tokens arrive: incremental decoding and stop strings.

A choice's text is the decoding of all its tokens so far. While it runs, what may be sent
is held back at the end:

* an incomplete UTF-8 sequence (decoded as U+FFFD) until its last byte arrives;
* the last ``len(longest stop string) - 1`` characters, which may be the start of a stop
  string, so a stop string is never partly sent.

When a stop string appears (anywhere in the text not yet checked, even across tokens) the
text ends before it and the choice is done: ``finish_reason`` ``"stop"``, the stop string
its ``stop_reason``, as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from events.tokenizer import Tokenizer

__all__ = ["ChoiceText"]


class ChoiceText:
    """The text of one choice, with its stop strings.

    Args:
        tokenizer: Decodes the token ids.
        stop: Strings that end the choice (not included in its text).

    Attributes:
        stop_reason: The stop string found, once one was.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        # NOTE: characters at the end that could begin a stop string.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self._text = ""
        self._num_sent = 0
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The text so far (all of it once finished), without any stop string."""
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the choice."""
        return self.stop_reason is not None

    def push(self, token_ids: Sequence[int], finished: bool) -> str:
        """Add a step's tokens; returns the text that may be sent now (maybe empty).

        Args:
            token_ids: The new tokens.
            finished: The engine finished the choice (nothing more is held back).
        """
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        text = self._tokenizer.decode(self._token_ids)
        if not finished:
            text = text.rstrip("\ufffd")
        if self._stop:
            # A stop string may straddle the text checked before and the new text.
            start = max(len(self._text) - self._hold, 0)
            found = [(i, s) for s in self._stop if (i := text.find(s, start)) >= 0]
            if found:
                at, self.stop_reason = min(found)
                text, finished = text[:at], True
        if not text.startswith(self._text[: self._num_sent]):
            # Decoding changed text already sent (a tokenizer's clean-up rule): keep what
            # was sent, never send it twice.
            text = self._text[: self._num_sent] + text[self._num_sent :]
        self._text = text
        end = len(text) if finished else max(len(text) - self._hold, self._num_sent)
        delta = text[self._num_sent : end]
        self._num_sent = end
        return delta
