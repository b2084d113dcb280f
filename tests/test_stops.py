"""Stop strings over streamed pieces against the plain rule: output = text up to the first stop, and
after each piece, everything but the longest end of the text that may still begin a stop string."""

import random

from moerun.text.stops import StopMatcher


def _run(pieces, stops):
    matcher, out = StopMatcher(stops), []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def _expected(text, stops):
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _brute_force(pieces, stops):
    """What each push should give, from the whole text so far by `find` and `endswith` alone."""
    stops, text, released, steps = [s for s in stops if s], "", 0, []
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            steps.append((text[released : min(hits)], True))
            return steps, ""
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        steps.append((text[released : len(text) - hold], False))
        released = len(text) - hold
    return steps, text[released:]


def _cut(rng, text, most):
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(most))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_random_splits_agree_with_the_plain_rule():
    rng = random.Random(0)
    alphabet = "ab<|>\n "
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(3))
        ]
        pieces = _cut(rng, text, 6)
        assert _run(pieces, [*stops, ""]) == _expected(text, stops), (pieces, stops)


def test_each_push_releases_what_a_brute_force_rule_releases():
    """Random texts over small alphabets (so stop strings overlap, nest and repeat themselves, the
    cases an automaton's fail links handle), cut into random pieces, pushed one by one: every push's
    text and flag, and the final flush, equal the brute-force rule's."""
    rng = random.Random(1)
    for case in range(3000):
        alphabet = "ab" if case % 3 == 0 else "abc" if case % 3 == 1 else "ab<|>é日 "
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 9)))
            for _ in range(rng.randrange(0, 5))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(60)))
        if stops and rng.random() < 0.5:  # plant a stop string, maybe inside another's prefix
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(stops) + text[at:]
        pieces = _cut(rng, text, 12)
        steps, rest = _brute_force(pieces, stops)
        matcher = StopMatcher(stops)
        got = [matcher.push(piece) for piece in pieces[: len(steps)]]
        assert got == steps, (pieces, stops)
        if not steps or not steps[-1][1]:
            assert matcher.flush() == rest, (pieces, stops)


def test_text_is_released_as_soon_as_it_cannot_start_a_stop():
    matcher = StopMatcher(["</s>"])
    assert matcher.push("hello <") == ("hello ", False)  # "<" may begin "</s>": held
    assert matcher.push("b") == ("<b", False)  # no longer can
    assert matcher.push("</") == ("", False)
    assert matcher.push("s> tail") == ("", True)


def test_the_earliest_stop_in_one_piece_wins_over_the_first_to_end():
    # "b" ends first, but "abc" begins earlier: as `find` over the piece says
    assert StopMatcher(["abc", "b"]).push("xabc") == ("x", True)
    # pushed one character at a time, "b" is reached while "abc" is not yet
    matcher = StopMatcher(["abc", "b"])
    assert [matcher.push(c) for c in "xab"] == [("x", False), ("", False), ("a", True)]


def test_a_long_stop_string_held_back_and_released():
    stop = "x" * 5000 + "!"
    matcher = StopMatcher([stop, "?"])
    assert all(matcher.push("x") == ("", False) for _ in range(5000))  # each may begin the stop
    assert all(matcher.push("x") == ("x", False) for _ in range(2000))  # 5000 held, the rest out
    assert matcher.push("y") == ("x" * 5000 + "y", False)


def test_a_stop_held_over_many_tokens_releases_the_tokens_its_text_needs(tmp_path):
    """Token by token (moerun.batching.TextRelease): a long stop string is held back over many
    tokens; when another stop string ends it, the tokens released are the fewest whose text covers
    the text before the stop (checked by decoding every prefix), and their text is that text."""
    from tiny_tokenizers import byte_level_tokenizer, save_hf_dir

    from moerun.batching import TextRelease, Token
    from moerun.text import Tokenizer

    tokenizer = Tokenizer.from_hf_dir(save_hf_dir(byte_level_tokenizer("gpt2"), tmp_path))
    text = "Hello world! The quick brown fox jumps over the lazy dog. " * 4
    ids = tokenizer.encode(text, add_special_tokens=False)
    long_stop = text[6:150] + "#"  # begins in the text, never ends in it: held over many tokens
    release = TextRelease(tokenizer, [long_stop, "lazy"])
    out, stopped = [], False
    for i, token_id in enumerate(ids):
        tokens, stopped = release.push(Token(token_id), last=i == len(ids) - 1)
        out += tokens
        if stopped:
            break
    before = text[: text.index("lazy")]
    assert stopped and "".join(t.text for t in out) == before
    released = [t.id for t in out]
    assert tokenizer.decode(released).startswith(before)
    assert len(tokenizer.decode(released[:-1])) < len(before)  # one token fewer would not cover it
