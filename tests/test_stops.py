"""Stop strings over streamed pieces against the plain rule: output = text up to the first stop."""

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


def test_random_splits_agree_with_the_plain_rule():
    rng = random.Random(0)
    alphabet = "ab<|>\n "
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(pieces, stops) == _expected(text, stops), (pieces, stops)


def test_text_is_released_as_soon_as_it_cannot_start_a_stop():
    matcher = StopMatcher(["</s>"])
    assert matcher.push("hello <") == ("hello ", False)  # "<" may begin "</s>": held
    assert matcher.push("b") == ("<b", False)  # no longer can
    assert matcher.push("</") == ("", False)
    assert matcher.push("s> tail") == ("", True)
