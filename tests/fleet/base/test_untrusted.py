"""The one gate device text passes before a fleet command prints it: escapes shown, length capped."""

from __future__ import annotations

import pytest

from agent.fleet.base.untrusted import clipped, shown


@pytest.mark.parametrize(
    ("sent", "printed"),
    [
        ("jet-01", "jet-01"),
        ("Orin NX 日本 é", "Orin NX 日本 é"),  # printable text of any script stays as it is
        ("\x1b[1A\x1b[2Kjet-01 ACTIVE", "\\x1b[1A\\x1b[2Kjet-01 ACTIVE"),  # ESC: cursor up, erase line
        ("a\rb\bc\td\ne\x7f", "a\\x0db\\x08c\\x09d\\x0ae\\x7f"),  # C0 controls and DEL
        ("\x9b2K\x85", "\\x9b2K\\x85"),  # C1: the one-byte CSI and NEL
        ("\u202eEVITCA\u2066x\u2069", "\\u202eEVITCA\\u2066x\\u2069"),  # bidi override and isolates
        ("a\u200bb\ufeff\u2028", "a\\u200bb\\ufeff\\u2028"),  # zero width space, BOM, line separator
        ("\ud800", "\\ud800"),  # a lone surrogate: unprintable, would raise UnicodeEncodeError
        ("\U000e0041", "\\U000e0041"),  # a tag character (format, outside the BMP)
        (42, "42"),
    ],
)
def test_control_and_format_characters_become_visible_escapes(sent: object, printed: str) -> None:
    assert shown(sent, 200) == printed


def test_a_number_too_long_to_print_is_described() -> None:
    assert shown(10**5000) == "<number of 16610 bits>"  # str() of it raises ValueError


def test_long_text_is_cut_and_marked_never_inside_an_escape() -> None:
    assert shown("x" * 20_000_000, 10) == "xxxxxxx..."
    assert shown("abcdefghij", 10) == "abcdefghij"
    cut = shown("ab" + "\x1b" * 10, 12)
    assert cut == "ab\\x1b..."
    assert len(shown("\x1b" * 100, 40)) <= 40


def test_clipped_only_cuts() -> None:
    assert clipped("a\x1b" * 3, 100) == "a\x1b" * 3
    assert clipped("y" * 2000, 1024) == "y" * 1021 + "..."
