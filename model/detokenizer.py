"""Incremental detokenisation with stop strings, at a cost per token that does not grow with the
text generated so far.

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
  still incomplete) the window moves up, so a step decodes a handful of tokens (tokens whose
  text keeps ending in U+FFFD stay in the window until it ends cleanly: beyond three tokens only
  invalid bytes do that). DecodeStream itself is not used: it needs a `tokenizers.Tokenizer`, and
  the tiny models' byte tokenizer is none.
* A trailing run of U+FFFD is held back: it may be a UTF-8 sequence still incomplete (byte-level
  decoding gives one U+FFFD for it, byte-fallback decoders one per byte).
* Stop strings: an Aho-Corasick automaton over them is fed each committed character once; its
  state is the longest suffix of the text that begins some stop string, so that suffix (at most
  the longest stop string minus one character) is what is held back, and a stop string is found
  where it completes, across token boundaries, at O(new text) per token. The text stops at the
  first position where any stop string completes (the longest one ending there): the same
  wherever the token boundaries fall.

`resume(tokenizer, stop_strings, tokens, emitted)` rebuilds the state a detokenizer had after
`tokens` with `emitted` characters released (a migrated request: MigrationHeader carries both) by
running the window over `tokens` once, so the stream continues exactly.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StopMatcher:
    """Aho-Corasick automaton over stop strings: state 0 is the empty match."""

    def __init__(self, stops: tuple[str, ...]):
        self._goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        ends = [0]                                  # length of the stop string ending in a state
        for s in stops:
            state = 0
            for ch in s:
                nxt = self._goto[state].get(ch)
                if nxt is None:
                    nxt = self._goto[state][ch] = len(self._goto)
                    self._goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    ends.append(0)
                state = nxt
            ends[state] = len(s)
        self._fail = [0] * len(self._goto)
        # the longest stop string that is a suffix of a state's text (0: none), by breadth
        self._out = list(ends)
        queue = list(self._goto[0].values())
        for state in queue:
            for ch, nxt in self._goto[state].items():
                f = self._fail[state]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[nxt] = self._goto[f].get(ch, 0)
                self._out[nxt] = ends[nxt] or self._out[self._fail[nxt]]
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(ch, 0)

    def feed(self, state: int, text: str) -> tuple[int, int, int]:
        """Feed `text` from `state` up to the first completed stop string:
        (state, index in text just past it, its length), or (state, -1, 0) when none completes."""
        for i, ch in enumerate(text):
            state = self.step(state, ch)
            if self._out[state]:
                return state, i + 1, self._out[state]
        return state, -1, 0


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
        self._state = 0  # the matcher's state after the committed text
        self._held = ""  # committed text not released: it may begin a stop string
        self._skip = 0  # (resume) characters still to commit that were released before

    @classmethod
    def resume(cls, tokenizer, stop_strings: tuple[str, ...], tokens: list[int], emitted: int) -> Detokenizer:
        """The state another worker had after `tokens`, of whose text `emitted` characters were
        released: the next push() continues its stream exactly."""
        d = cls(tokenizer, stop_strings)
        committed = "".join(d._absorb(t) for t in tokens)
        d.emitted = d._skip = emitted
        releasable = d._release(committed)  # what that worker would release now, if anything:
        d._held = releasable + d._held  # it goes out with the next token instead
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
            out += self._held
            self.emitted += len(self._held)
            self._held = ""
        return out

    # --- the token window

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end])

    def _absorb(self, token: int) -> str:
        """Append `token`; return the text that became final (committed) with it."""
        self.tokens.append(token)
        window = self._decode(self._prefix)
        start = self._context + self._taken
        end = len(window.rstrip(REPLACEMENT)) if window.endswith(REPLACEMENT) else len(window)
        new = window[start:end] if end > start else ""
        if end == len(window) and len(window) > self._context:  # ends cleanly: move the window up
            self._prefix, self._read = self._read, len(self.tokens)
            self._context = len(self._decode(self._prefix, self._read))
            self._taken = 0
        else:
            self._taken += len(new)
        return new

    # --- stop strings

    def _release(self, new: str) -> str:
        """Commit `new`; return the part of the held-back and new text that is released now."""
        if self._skip:  # (resume) released by the worker before: only the matcher sees it
            seen, new = new[:self._skip], new[self._skip:]
            self._skip -= len(seen)
            if self._matcher is not None:
                for ch in seen:
                    self._state = self._matcher.step(self._state, ch)
        buf = self._held + new
        if self._matcher is None:
            self._held = ""
            self.emitted += len(buf)
            return buf
        self._state, end, length = self._matcher.feed(self._state, new)
        if end >= 0:  # a stop string completes: release what precedes it, nothing more ever
            out = buf[:max(0, len(self._held) + end - length)]
            self.stopped, self._held = True, ""
            self.emitted += len(out)
            return out
        keep = min(self._matcher.depth[self._state], len(buf))
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.emitted += len(out)
        return out
