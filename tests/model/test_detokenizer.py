"""The incremental detokenizer releases, token by token, exactly what re-decoding every token at
every step would (`naive` below, the definition), at a cost linear in the stream: on the tiny
models' byte tokenizer, on a `tokenizer.json` with byte-fallback tokens, with stop strings split
across tokens, and resumed mid-stream from (tokens, emitted) as a migrated request is."""

import random

import pytest

from model.detokenizer import HOLD_TOKENS, Detokenizer
from model.tiny import tiny_config
from model.tokenizer import ByteTokenizer, HFTokenizer

BYTES = ByteTokenizer(tiny_config().vocab_size)
FFFD = "\ufffd"
WORDS = ["hello", "world", "the", "stop", "here", "naïve", "café", "中文", "字", "😀", "€",
         "🇯🇵", "ß", "नमस्ते", " ", ", ", "\n"]


def first_stop(text, stops):
    """Where the text ends at a stop string: the first position any stop string completes at
    (the longest one completing there); None if none occurs."""
    hits = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    return min(hits)[0] + min(hits)[1] if hits else None


def naive(tok, stops, tokens):
    """(text released per token, then by flush; stopped): everything re-decoded at every step.
    The final text is the text up to its trailing U+FFFD run; but once more than HOLD_TOKENS
    tokens came since the text last ended cleanly (a run of invalid bytes), the text of all but
    the last HOLD_TOKENS tokens is final too if it decodes alike cut off there (no character
    straddles the cut). Of the final text, a suffix that begins a stop string is held back."""
    out, emitted, final, read = [], 0, 0, 0
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n])
        if not text.endswith(FFFD):
            read = n if len(text) > len(tok.decode(tokens[:read])) else read
        elif n - read > HOLD_TOKENS:
            head = tok.decode(tokens[:n - HOLD_TOKENS])
            if head + tok.decode(tokens[n - HOLD_TOKENS:n]) == text:
                final, read = max(final, len(head)), n - HOLD_TOKENS
        final = max(final, len(text.rstrip(FFFD)))
        stable = text[:final]
        at = first_stop(stable, stops)
        if at is not None:
            return out + [text[emitted:max(at, emitted)]], True
        keep = max((k for s in stops for k in range(1, len(s)) if stable.endswith(s[:k])), default=0)
        upto = max(emitted, len(stable) - keep)
        out.append(text[emitted:upto])
        emitted = upto
    text = tok.decode(tokens)
    at = first_stop(text, stops)
    return out + [text[emitted:len(text) if at is None else at]], at is not None


def stream(d, tokens):
    """(text released per token, then by flush; stopped)."""
    out, start = [], d.emitted
    for t in tokens:
        out.append(d.push(t))
        assert d.emitted == start + sum(map(len, out))
        if d.stopped:
            return out, True
    return out + [d.flush()], False


def random_text_tokens(tok, rng, n):
    ids = []
    while len(ids) < n:
        ids += tok.encode(rng.choice(WORDS))
    return ids[:n]


def random_ids(rng, n):
    """Any id of the tiny vocabulary: bytes (most invalid where they fall), specials, unused ids."""
    return [rng.randrange(BYTES.vocab_size) for _ in range(n)]


# --------------------------------------------------------------------------- equality

@pytest.mark.parametrize("seed", range(40))
def test_random_streams_of_the_tiny_tokenizer_equal_a_full_redecode(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    tokens = random_ids(rng, n) if seed % 2 else random_text_tokens(BYTES, rng, n)
    got, stopped = stream(Detokenizer(BYTES), tokens)
    assert (got, stopped) == naive(BYTES, (), tokens)
    assert "".join(got) == BYTES.decode(tokens) and not stopped


def test_multibyte_characters_arriving_a_byte_at_a_time():
    text = "naïve café 中文字 😀 🇯🇵 € नमस्ते ß"
    d, out = Detokenizer(BYTES), []
    for b in text.encode():
        out.append(d.push(b))
        assert FFFD not in out[-1]                  # an incomplete character is never released
        assert text.startswith("".join(out))
    assert "".join(out) + d.flush() == text


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A Llama-style tokenizer.json: BPE over a few words and letters, every other character as
    byte-fallback tokens <0xNN> (decoded one U+FFFD per byte until a character is complete), a
    leading-space marker the decoder strips at the start of a decode."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'▁中文字":
        vocab.setdefault(c, len(vocab))
    merges = []
    for word in ("▁hello", "▁world", "▁the", "▁stop", "▁here", "ing", "▁中文"):
        for i in range(2, len(word) + 1):
            merges.append((word[:i - 1], word[i - 1]))
            vocab.setdefault(word[:i], len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, 1, 2)


def test_byte_fallback_tokens_equal_a_full_redecode(hf_tok):
    emoji = hf_tok.encode("a 😀")
    assert sum(t in range(3, 259) for t in emoji) == 4  # the emoji is four byte tokens
    rng = random.Random(7)
    for _ in range(60):
        tokens = []
        for _ in range(rng.randrange(1, 12)):  # separate encodings: token boundaries inside words
            tokens += hf_tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 4))))
        got, stopped = stream(Detokenizer(hf_tok), tokens)
        assert (got, stopped) == naive(hf_tok, (), tokens)
        assert "".join(got) == hf_tok.decode(tokens)
        assert all(FFFD not in piece for piece in got)


# --------------------------------------------------------------------------- stop strings

class PieceTok:
    """Token i decodes to pieces[i]."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_partial_stop_strings_are_held_back():
    d = Detokenizer(PieceTok(["Hel", "lo ", "wor", "ld", "!!"]), stop_strings=("world",))
    assert [d.push(0), d.push(1), d.push(2)] == ["Hel", "lo ", ""]  # "wor" may start "world"
    assert d.push(3) == "" and d.stopped and d.emitted == 6 and d.flush() == ""
    d = Detokenizer(PieceTok(["ab", "wo", "x"]), stop_strings=("world",))
    assert d.push(0) + d.push(1) == "ab" and d.push(2) == "wox" and not d.stopped


def test_a_stop_split_over_many_tokens_and_overlapping_stops():
    d = Detokenizer(PieceTok(["ab", "cS", "T", "OPde"]), stop_strings=("STOP", "xyz"))
    assert [d.push(i) for i in range(4)] == ["ab", "c", "", ""] and d.stopped
    # "bc" completes before "abcd" would: the text ends where the first stop string completes
    d = Detokenizer(PieceTok(["xabcd"]), stop_strings=("abcd", "bc"))
    assert d.push(0) == "xa" and d.stopped
    # two ending at the same place: the longer one (it starts first)
    d = Detokenizer(PieceTok(["xyzab"]), stop_strings=("zab", "yzab", "b"))
    assert d.push(0) == "x"
    # a stop string in the middle of a multi-byte character's bytes
    d = Detokenizer(BYTES, stop_strings=("文本",))
    assert "".join(d.push(b) for b in "中文本!".encode() if not d.stopped) == "中" and d.stopped


@pytest.mark.parametrize("seed", range(30))
def test_stops_on_random_streams_equal_the_naive_definition(seed):
    rng = random.Random(100 + seed)
    tokens = random_text_tokens(BYTES, rng, rng.randrange(1, 200))
    text = BYTES.decode(tokens)
    stops = tuple(text[i:i + rng.randrange(1, 6)] for i in rng.sample(range(len(text)), 2))
    stops += ("€ü", "zzzzzz", "ld, w") if seed % 3 else ()
    d = Detokenizer(BYTES, stops)
    got, stopped = [], False
    longest = max(map(len, stops))
    for n, t in enumerate(tokens, 1):
        got.append(d.push(t))
        if d.stopped:
            stopped = True
            break
        # what is held for the stop strings never exceeds the longest one minus a character
        assert len(BYTES.decode(tokens[:n]).rstrip(FFFD)) - d.emitted <= longest - 1
    if not stopped:
        got.append(d.flush())
    assert (got, stopped) == naive(BYTES, stops, tokens)


def test_the_output_does_not_depend_on_token_boundaries():
    rng = random.Random(5)
    text = "the café said: stop here, or stop there 中文 STOP! then more text"
    for stops in [("stop there",), ("here, or", "said"), ("中文 S", "zz"), ("STOP", "OP!"), ("nope",)]:
        at = first_stop(text, stops)
        want = text if at is None else text[:at]
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 12)))
            pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
            got, stopped = stream(Detokenizer(PieceTok(pieces), stops), range(len(pieces)))
            assert "".join(got) == want and stopped == (at is not None), (stops, pieces)


# --------------------------------------------------------------------------- resume

@pytest.mark.parametrize("seed", range(20))
def test_resume_mid_stream_equals_an_unbroken_stream(seed, hf_tok):
    rng = random.Random(200 + seed)
    tok = hf_tok if seed % 2 else BYTES
    tokens = random_text_tokens(tok, rng, rng.randrange(2, 150))
    text = tok.decode(tokens)
    stops = (text[len(text) // 2:len(text) // 2 + 3], "zq") if seed % 3 else ()
    unbroken, stopped = stream(Detokenizer(tok, stops), tokens)
    cut = rng.randrange(1, len(unbroken))  # tokens pushed before the move: the stream went on after
    first = Detokenizer(tok, stops)
    before = [first.push(t) for t in tokens[:cut]]
    assert not first.stopped
    moved = Detokenizer.resume(tok, stops, tokens[:cut], first.emitted)
    after, moved_stopped = stream(moved, tokens[cut:])
    assert before + after == unbroken and moved_stopped == stopped
    # a worker that had released less (held more back) than this one would: the text still
    # continues exactly where it left off
    lag = rng.randrange(0, first.emitted + 1)
    resumed = Detokenizer.resume(tok, stops, tokens[:cut], lag)
    rest, _ = stream(resumed, tokens[cut:])
    assert "".join(before)[:lag] + "".join(rest) == "".join(unbroken)


# --------------------------------------------------------------------------- cost

class CountingTok:
    """Counts the tokens passed to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def test_decoding_cost_is_linear_in_the_stream():
    rng = random.Random(11)
    n = 5000
    tokens = random_text_tokens(BYTES, rng, n // 2) + random_ids(rng, n // 2)
    tok = CountingTok(BYTES)
    d = Detokenizer(tok, ("a stop that never comes", "q€", "字😀x"))
    out, _ = stream(d, tokens)
    assert "".join(out) == BYTES.decode(tokens)
    assert tok.decoded < 20 * n, tok.decoded
    # re-decoding everything at every step (the definition) fails the bound long before 5,000
    tok = CountingTok(BYTES)
    naive(tok, (), tokens[:1000])
    assert tok.decoded > 20 * 1000


@pytest.mark.parametrize("run", [[0xC3], [0xF0, 0x9F], [0xE2, 0x82, 0xC3], [0x80]],
                         ids=["C3", "F09F", "E282C3", "80"])
def test_a_run_of_invalid_bytes_is_released_as_it_comes_at_a_bounded_cost(run):
    """A model stuck on bytes that never form a character: its text (U+FFFD each) goes out as it
    comes, but for the last tokens, and each step decodes a bounded window."""
    tokens = run * (3000 // len(run)) + list(" end 😀".encode())
    assert naive(BYTES, (), tokens[:300]) == stream(Detokenizer(BYTES), tokens[:300])
    tok = CountingTok(BYTES)
    d = Detokenizer(tok)
    out = [d.push(t) for t in tokens[:1000]]
    released = "".join(out)
    assert BYTES.decode(tokens).startswith(released)
    assert len(released) >= len(BYTES.decode(tokens[:1000 - 2 * HOLD_TOKENS]))
    out += [d.push(t) for t in tokens[1000:]] + [d.flush()]
    assert "".join(out) == BYTES.decode(tokens) and out[-5:] == ["", "", "", "😀", ""]
    assert tok.decoded < 20 * len(tokens), tok.decoded


def stop_heavy_text():
    """Text that follows long stop strings a long way without completing one: runs of x (the
    x-run stops), runs of ab (the periodic ones: failure chains as deep as the run)."""
    return ("x" * 3000 + "y" + "ab" * 1500 + "c") * 3


def never_completing(length):
    """16 stop strings of `length` characters the text above follows for all but their last one."""
    xs = tuple("x" * (length - 1) + chr(ord("A") + i) for i in range(8))
    abs_ = tuple(("ab" * length)[:length - 1] + chr(ord("0") + i) for i in range(8))
    return xs + abs_


def test_stop_strings_cost_what_the_text_matches_not_their_length():
    """16 stop strings of 4,096 characters: nothing is paid for them up front, and the work per
    character of text stays within a constant per stop string, at every token (a cost per token
    in the stop strings' length, such as copying the held-back text, would add 4,095 a token)."""
    text = stop_heavy_text()
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]  # 7-character tokens
    stops = never_completing(4096)

    def run(stops):
        d = Detokenizer(PieceTok(pieces), stops)
        assert d.examined <= len(stops)  # building
        out, chars = [], 0
        for i, piece in enumerate(pieces):
            out.append(d.push(i))
            chars += len(piece)
            assert d.examined <= (4 * len(stops) + 2) * chars, (i, d.examined)
            assert chars - d.emitted <= max(map(len, stops)) - 1
        out.append(d.flush())
        assert "".join(out) == text and not d.stopped
        return d.examined

    long = run(stops)
    assert long <= 2 * run(never_completing(64))  # the same work with stop strings of 64 characters


def test_long_stop_strings_allocate_nothing_up_front():
    """The router lets 16 stop strings fill the request body (no limit per string): a request
    must not get an automaton built over all of it before its first token."""
    import tracemalloc

    letters = bytes.maketrans(bytes(range(256)), b"abcdefgh" * 32)
    stops = tuple(random.Random(i).randbytes(65536).translate(letters).decode() for i in range(16))
    tracemalloc.start()
    try:
        d = Detokenizer(BYTES, stops)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak  # the stop strings themselves (1 MiB) are the caller's
    assert d.push(ord("a")) == "" and d.push(ord("z")) == "az"
