import random

import pytest

from mindspec.text_generator.stop_strings import StopStringMatcher


def run(matcher, chunks):
    out, matched = [], False
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        out.append(text)
        if matched:
            break
    if not matched:
        out.append(matcher.flush())
    return "".join(out), matched


def reference(chunks, stops):
    """After each chunk, cut the text so far at the earliest occurrence of any stop string."""
    seen = ""
    for chunk in chunks:
        seen += chunk
        hits = [seen.find(s) for s in stops if s in seen]
        if hits:
            return seen[: min(hits)], True
    return seen, False


def test_no_stop_strings_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_match_within_one_chunk():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello STOP world") == ("hello ", True)
    assert m.matched and m.matched_stop == "STOP"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_match_across_chunks():
    m = StopStringMatcher(["</end>"])
    assert m.feed("abc</") == ("abc", False)
    assert m.held == "</"
    assert m.feed("en") == ("", False)
    assert m.feed("d>tail") == ("", True)
    assert m.matched_stop == "</end>"


def test_prefix_hold_back_then_released():
    m = StopStringMatcher(["###"])
    assert m.feed("a#") == ("a", False)
    assert m.feed("#") == ("", False)
    assert m.feed("b") == ("##b", False)
    assert m.feed("c##") == ("c", False)
    assert m.flush() == "##"
    assert not m.matched


def test_earliest_of_several():
    m = StopStringMatcher(["world", "lo w", "xyz"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched_stop == "lo w"


def test_held_text_plus_new_text_matches():
    m = StopStringMatcher(["ab", "bc"])
    assert m.feed("xa") == ("x", False)
    assert m.feed("bc") == ("", True)
    assert m.matched_stop == "ab"


def test_unicode_stop_across_chunks():
    m = StopStringMatcher(["再见😀"])
    assert m.feed("你好再") == ("你好", False)
    assert m.feed("见") == ("", False)
    assert m.feed("😀!") == ("", True)


def test_hold_is_bounded_by_longest_stop():
    m = StopStringMatcher(["abcdef"])
    text, matched = m.feed("x" * 20 + "abcde")
    assert (text, matched) == ("x" * 20, False)
    assert len(m.held) <= 5


def test_empty_stop_strings_ignored():
    m = StopStringMatcher(["", "z"])
    assert m.stop_strings == ("z",)
    assert m.feed("abz") == ("ab", True)


@pytest.mark.parametrize("seed", range(200))
def test_random_chunking_matches_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab#"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    chunks, i = [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        chunks.append(text[i : i + k])
        i += k
    assert run(StopStringMatcher(stops), chunks) == reference(chunks, stops)
    # Fed one character at a time, nothing is emitted past the first completed stop string.
    got_text, matched = run(StopStringMatcher(stops), list(text))
    assert (got_text, matched) == reference(list(text), stops)
    assert text.startswith(got_text) and not any(s in got_text for s in stops)
