"""Incremental detokenisation with stop strings.

Text is re-decoded from all generated tokens (tokenizers merge bytes across tokens), and only
the stable part is released: a trailing U+FFFD (an incomplete UTF-8 sequence) and any suffix
that could still grow into a stop string are held back until the next token decides them.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the decoded text already released
        self.stopped = False

    @classmethod
    def resume(cls, tokenizer, stop_strings: tuple[str, ...], tokens: list[int], emitted: int) -> "Detokenizer":
        """The state another worker had after `tokens`, of whose text `emitted` characters were
        released: text depends only on these, so the stream continues exactly."""
        d = cls(tokenizer, stop_strings)
        d.tokens, d.emitted = list(tokens), emitted
        return d

    def push(self, token: int) -> str:
        """Add one token; return newly released text. Sets `stopped` when a stop string appears
        (the stop string and anything after it are never released)."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at >= 0:
                self.stopped = True
                out, self.emitted = text[self.emitted:at], at
                return out
        stable = len(text)
        if text.endswith("\ufffd"):
            stable -= 1
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, stable), 0, -1):
                if text[:stable].endswith(stop[:k]):
                    stable = min(stable, len(text[:stable]) - k)
                    break
        stable = max(stable, self.emitted)
        out, self.emitted = text[self.emitted:stable], stable
        return out

    def flush(self) -> str:
        """Release held-back text at the end of generation (not after a stop string)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.tokens)
        out, self.emitted = text[self.emitted:], len(text)
        return out
