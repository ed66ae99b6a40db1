"""docs/gpus.md's table of GPU recipes is the one generated from the recipes' headers
(tools/recipe_table.py): a recipe added without its row, or a row edited on the page only,
fails here. (The table once said nine recipes where configs/gpu/ held ten.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import recipe_table  # noqa: E402


def test_the_page_s_table_is_the_generated_one():
    page = recipe_table.PAGE.read_text()
    assert page == recipe_table.render(page), "docs/gpus.md is stale: python tools/recipe_table.py"
    rows = [x for x in page.splitlines() if x.startswith("| `configs/gpu/")]
    assert len(rows) == len(list((ROOT / "configs" / "gpu").glob("*.yaml")))


def test_each_row_s_mesh_is_its_recipe_s():
    for path in sorted((ROOT / "configs" / "gpu").glob("*.yaml")):
        mesh_cell = recipe_table.row(path).split(" | ")[3]
        mesh = yaml.safe_load(path.read_text())["mesh"]
        named = dict((axis, int(n)) for axis, n in re.findall(r"(\w+) (\d+)", mesh_cell))
        for axis, size in mesh.items():
            if size not in (1, -1):
                assert named.get(axis) == size, f"{path.name}: mesh.{axis}={size}, row {mesh_cell}"
        for axis, n in named.items():
            assert mesh.get(axis) in (n, -1), f"{path.name}: the row says {axis} {n}"


def test_a_recipe_without_its_line_is_named(tmp_path):
    bare = tmp_path / "bare.yaml"
    bare.write_text("# python -m jaxmllm.train --config bare.yaml\nmesh: {fsdp: 8}\n")
    with pytest.raises(ValueError, match="bare.yaml: give the recipe one header line '# Table:"):
        recipe_table.row(bare)
