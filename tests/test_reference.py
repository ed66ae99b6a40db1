"""The configuration reference page (docs/reference.md) is the one generated from the typed
configs: a key added, renamed or re-commented without regenerating it fails here."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from jaxmllm.config import Config
from jaxmllm.config.reference import field_help, render, section_type, sections

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


@pytest.fixture(scope="module")
def page() -> str:
    """The generated page, rendered once for the tests that read it (each field's comments are
    read from its source file)."""
    return render()


def test_the_committed_page_is_the_generated_one(page):
    assert PAGE.read_text() == page, (
        "docs/reference.md is stale: python -m jaxmllm.config.reference --out docs/reference.md"
    )


def test_every_key_is_on_the_page_with_its_help(page):
    for name, cls in sections(Config):
        for f in dataclasses.fields(cls):
            if name and f.init and section_type(typing.get_type_hints(cls)[f.name]) is None:
                row = next(r for r in page.splitlines() if r.startswith(f"| `{name}{f.name}` |"))
                assert row.rstrip(" |").rsplit("|", 1)[1].strip(), f"{name}{f.name}: no comment"


def test_a_fields_help_is_its_comment_above_and_beside(tmp_path):
    @dataclasses.dataclass
    class Section:
        # what the first one is,
        # over two lines
        first: int = 1  # and its unit
        second: int = 2
        third: str = ""  # its own

        plain: bool = True

    helps = field_help(Section, "s.")
    assert helps["first"] == "what the first one is, over two lines — and its unit"
    assert helps["second"] == "see `s.first`"  # (under the same comment)
    assert helps["third"] == "its own"
    assert helps["plain"] == ""  # (no comment at all; the config's own fields all have one)
