"""The documentation site: its home page lists every page, and it reads the same from disk as
served (its links name files, not folders)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

ROOT = Path(__file__).resolve().parents[1]


def _site() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _pages(nav) -> list[str]:
    out = []
    for entry in nav:
        for value in entry.values():
            out += _pages(value) if isinstance(value, list) else [value]
    return out


def test_the_home_page_links_every_page_of_the_navigation():
    site = _site()
    pages = _pages(site["nav"])
    home = (ROOT / site["docs_dir"] / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", home))
    assert pages[0] == "index.md"
    missing = [page for page in pages[1:] if page not in linked]
    assert not missing, f"docs/index.md does not link {missing}"
    on_disk = sorted(p.name for p in (ROOT / site["docs_dir"]).glob("*.md"))
    assert sorted(pages) == on_disk  # (mkdocs --strict: a page left out of the nav fails it)


def test_the_site_links_files_so_it_reads_from_disk():
    assert _site()["use_directory_urls"] is False
