"""Incremental detokenisation with stop strings, at a cost per token that grows neither with the
text generated so far nor with the length of the stop strings.

    d = Detokenizer(tokenizer, stop_strings)
    for token in stream: text += d.push(token); if d.stopped: break
    text += d.flush()                                     # at the end (nothing after a stop)

Released text, concatenated, is exactly the text of every token decoded at once (up to a stop
string): what cannot be final yet is held back until a later token decides it.

* Token windows (the prefix/read offsets of vLLM's `detokenize_incrementally`, which the
  `tokenizers` DecodeStream also uses). A token's text can depend on the tokens before it (byte
  tokens merge into one character, a leading-space marker is dropped at the start of a
  decode), so each step decodes `tokens[prefix:]` and takes the text past
  `decode(tokens[prefix:read])`: `tokens[prefix:read]` is the context, `tokens[read:]` the tokens
  whose text is not all committed. Once the window's text ends cleanly (no U+FFFD: no character
  still incomplete) the window moves up, so a step decodes a handful of tokens. A window whose
  text keeps ending in U+FFFD (a run of invalid bytes) moves up too once more than
  `HOLD_TOKENS` tokens are past `read`: an incomplete UTF-8 character is at most three bytes, so
  the text of every token but the last four is final, if it decodes alike with the window cut
  there (`decode(a) + decode(b) == decode(a + b)`: no character straddles the cut). Without that
  such a run would be decoded whole at every step. DecodeStream itself is not used: it needs a
  `tokenizers.Tokenizer`, and the tiny models' byte tokenizer is none.
* A trailing run of U+FFFD is held back (up to that cut): it may be a UTF-8 sequence still
  incomplete (byte-level decoding gives one U+FFFD for it, byte-fallback decoders one per byte).
* Stop strings: a Knuth-Morris-Pratt matcher per stop string is fed each committed character
  once. Its failure tables are extended only as far as the text ever matched the stop string, so
  a request pays nothing up front for long stop strings (an automaton built over them in full
  would cost time and memory in their total length, per request, before the first token). The
  matchers tell the longest suffix of the text that begins some stop string; that suffix (at
  most the longest stop string minus one character) is what is held back, in a deque that each
  character enters and leaves once, and a stop string is found where it completes, across token
  boundaries. The text stops at the first position where any stop string completes (the longest
  one ending there): the same wherever the token boundaries fall. A character costs O(1) per
  stop string it currently continues or starts (amortised: a failure move gives back a
  character a match gained), whatever the stop strings' length; `examined` counts that work
  (comparisons, failure moves and table entries, characters into and out of the held-back text).

`resume(tokenizer, stop_strings, tokens, emitted)` rebuilds the state a detokenizer had after
`tokens` with `emitted` characters released (a migrated request: MigrationHeader carries both) by
running the window over `tokens` once, so the stream continues exactly.
"""

from __future__ import annotations

from collections import deque

REPLACEMENT = "\ufffd"
HOLD_TOKENS = 4  # tokens a trailing U+FFFD run may still be completed by (a character: ≤ 4 bytes)


class StopMatcher:
    """Where the text fed so far stands against each stop string: Knuth-Morris-Pratt per stop
    string, with each failure table extended only as far as the text ever matched, so building
    costs nothing and a stop string's length costs nothing unless the text follows it that far.

    `partial`: the longest suffix of the text that begins some stop string (what must be held
    back). `steps` counts the work done: comparisons, failure moves, table entries computed."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._tables: list[list[int]] = [[0] for _ in stops]  # KMP failure tables, as far as needed
        self._starting: dict[str, list[int]] = {}  # first character → the stop strings it begins
        for i, s in enumerate(stops):
            self._starting.setdefault(s[0], []).append(i)
        self._matched: dict[int, int] = {}  # stop string → characters of it the text ends with (> 0)
        self.steps = 0

    @property
    def partial(self) -> int:
        return max(self._matched.values(), default=0)

    def feed(self, text: str) -> tuple[int, int]:
        """Feed `text` up to the first completed stop string: (index in text just past it, its
        length; the longest one completing there), or (-1, 0) when none completes."""
        stops, steps = self.stops, 0
        for at, ch in enumerate(text):
            matched = {}
            for i, m in self._matched.items():
                s = stops[i]
                steps += 1
                while m and s[m] != ch:  # each fall gives back a character a match gained
                    m = self._fail(i, m)
                    steps += 1
                if s[m] == ch:
                    matched[i] = m + 1
            for i in self._starting.get(ch, ()):
                steps += 1
                matched.setdefault(i, 1)
            self._matched = matched
            done = [m for i, m in matched.items() if m == len(stops[i])]
            if done:
                self.steps += steps
                return at + 1, max(done)
        self.steps += steps
        return -1, 0

    def _fail(self, i: int, m: int) -> int:
        """The longest proper border of stop string i's first m characters (m > 0), extending
        its failure table up to there if needed."""
        s, table = self.stops[i], self._tables[i]
        while len(table) < m:  # table[q]: border of s[:q + 1]
            q = len(table)
            k = table[q - 1]
            while k and s[q] != s[k]:
                k = table[k - 1]
                self.steps += 1
            table.append(k + 1 if s[q] == s[k] else 0)
            self.steps += 1
        return table[m - 1]


class Detokenizer:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the text released so far
        self.stopped = False
        self._prefix = self._read = 0  # the window: tokens[prefix:read] context, tokens[read:] new
        self._context = 0  # len(decode(tokens[prefix:read]))
        self._taken = 0  # characters of the window past the context already committed
        self._matcher = StopMatcher(self.stop_strings) if self.stop_strings else None
        self._held: deque[str] = deque()  # committed characters not released: they may begin a stop string
        self._moved = 0  # characters into and out of _held
        self._skip = 0  # (resume) characters still to commit that were released before

    @property
    def examined(self) -> int:
        """The stop-string path's work so far (StopMatcher.steps + characters held and released)."""
        return (self._matcher.steps if self._matcher is not None else 0) + self._moved

    @classmethod
    def resume(cls, tokenizer, stop_strings: tuple[str, ...], tokens: list[int], emitted: int) -> Detokenizer:
        """The state another worker had after `tokens`, of whose text `emitted` characters were
        released: the next push() continues its stream exactly."""
        d = cls(tokenizer, stop_strings)
        committed = "".join(d._absorb(t) for t in tokens)
        d.emitted = d._skip = emitted
        releasable = d._release(committed)  # what that worker would release now, if anything:
        d._held.extendleft(reversed(releasable))  # it goes out with the next token instead
        d.emitted -= len(releasable)
        return d

    def push(self, token: int) -> str:
        """Add one token; return newly released text. Sets `stopped` when a stop string
        completes (the stop string and anything after it are never released)."""
        if self.stopped:
            self.tokens.append(token)
            return ""
        return self._release(self._absorb(token))

    def flush(self) -> str:
        """Release held-back text at the end of generation (nothing after a stop string)."""
        if self.stopped:
            return ""
        window = self._decode(self._prefix)
        new = window[self._context + self._taken:]
        self._taken += len(new)
        out = self._release(new)
        if not self.stopped:  # no stop string can complete any more: release what was held
            out += self._take(len(self._held))
        return out

    # --- the token window

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end])

    def _absorb(self, token: int) -> str:
        """Append `token`; return the text that became final (committed) with it."""
        self.tokens.append(token)
        window = self._decode(self._prefix)
        start = self._context + self._taken
        clean = not window.endswith(REPLACEMENT)
        end = len(window) if clean else len(window.rstrip(REPLACEMENT))
        if not clean and len(self.tokens) - self._read > HOLD_TOKENS:
            # a run of invalid bytes: the text of all but the last tokens is final if no
            # character straddles the cut
            cut = len(self.tokens) - HOLD_TOKENS
            head = self._decode(self._prefix, cut)
            if head + self._decode(cut) == window:
                end = max(start, end, len(head))
                self._prefix = self._read = cut
                self._context, self._taken = 0, end - len(head)
                return window[start:end]
        new = window[start:end] if end > start else ""
        if clean and len(window) > self._context:  # ends cleanly: move the window up
            self._prefix, self._read = self._read, len(self.tokens)
            self._context = len(self._decode(self._prefix, self._read))
            self._taken = 0
        else:
            self._taken += len(new)
        return new

    # --- stop strings

    def _take(self, n: int) -> str:
        """Release the first `n` held characters."""
        held = self._held
        if n == len(held):
            out = "".join(held)
            held.clear()
        else:
            out = "".join([held.popleft() for _ in range(n)])
        self._moved += n
        self.emitted += n
        return out

    def _release(self, new: str) -> str:
        """Commit `new`; return the part of the held-back and new text that is released now."""
        if self._skip:  # (resume) released by the worker before: only the matcher sees it
            seen, new = new[:self._skip], new[self._skip:]
            self._skip -= len(seen)
            if self._matcher is not None:
                self._matcher.feed(seen)  # no stop string completes in released text
        if self._matcher is None:
            out = self._take(len(self._held)) + new if self._held else new
            self.emitted += len(new)
            return out
        end, length = self._matcher.feed(new)
        if end >= 0:  # a stop string completes: release what precedes it, nothing more ever
            self._held.extend(new[:end])
            self._moved += end
            out = self._take(max(0, len(self._held) - length))
            self.stopped = True
            self._held.clear()
            return out
        self._held.extend(new)
        self._moved += len(new)
        return self._take(len(self._held) - min(self._matcher.partial, len(self._held)))
