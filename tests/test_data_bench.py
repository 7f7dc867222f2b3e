"""bench.data_bench's docs/benchmarks.md writer keeps every other section verbatim."""

from __future__ import annotations

from bench.data_bench import SECTION, replace_section, summary

NEW = SECTION + "\n\nnew table\n"


def test_section_added_to_missing_or_empty_file():
    assert replace_section("", NEW) == "# Benchmarks\n\n" + NEW
    assert replace_section("# Benchmarks\n\n## Recovery\n\nx\n", NEW) == \
        "# Benchmarks\n\n## Recovery\n\nx\n\n" + NEW


def test_section_replaced_in_place_others_verbatim():
    text = ("# Benchmarks\n\nintro  \n\n## Recovery\n\n| a |\n\n" + SECTION + "\n\nold\n### sub\nold\n\n"
            "## Later\n\nkeep\n")
    out = replace_section(text, NEW)
    assert out == "# Benchmarks\n\nintro  \n\n## Recovery\n\n| a |\n\n" + NEW + "\n## Later\n\nkeep\n"
    assert replace_section(out, NEW) == out  # idempotent
    assert replace_section(text.split(SECTION)[0] + SECTION + "\nold\n", NEW).endswith(NEW)


def test_summary():
    s = summary([3, 1, 2])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2, 1, 3, 3)
