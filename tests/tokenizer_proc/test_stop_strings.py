from __future__ import annotations

import pytest

from tokenizer_proc.stop_strings import find_safe_end, held_suffix_len, trim_at_stop


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello wor", ["world"], 6),  # "wor" may become "world"
        ("hello world!", ["world"], 6),  # a full occurrence is never shown
        ("hello wax", ["world"], 9),  # "wax" cannot start "world"
        ("abc", [], 3),
        ("say ###", ["##", "###!"], 4),  # the first occurrence of "##" wins
        ("ab END x E", ["END", "EOF"], 3),
        ("x </s", ["</s>", "</stop>"], 2),  # longest held suffix over all stops
    ],
)
def test_find_safe_end(text, stops, expected):
    assert find_safe_end(text, stops) == expected


def test_held_suffix_is_a_proper_prefix_only():
    assert held_suffix_len("abcSTOP", ["STOP"]) == 0  # a whole stop string is not a prefix
    assert held_suffix_len("abcSTO", ["STOP"]) == 3
    assert held_suffix_len("aaa", ["aab"]) == 2


def test_trim_at_first_occurrence():
    assert trim_at_stop("one. two. three.", ". ") == "one"
    assert trim_at_stop("no match here", "zzz") == "no match here"
    assert trim_at_stop("text", "") == "text"
