"""The GPU recipes' table in docs/gpus.md, generated from the recipes' own headers: each
configs/gpu/*.yaml says in one header line `# Table: model | GPUs | mesh | per GPU and
microbatch`, so a recipe added is a row of the page (tests/test_recipe_table.py holds them
equal).

    python tools/recipe_table.py          # rewrites the table in docs/gpus.md
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "gpus.md"
BEGIN, END = "<!-- recipes: tools/recipe_table.py -->", "<!-- /recipes -->"
HEAD = "| recipe | model | GPUs | mesh | per GPU and microbatch |\n|---|---|---|---|---|\n"
# The order of the rows: one node before several, smaller models first (a file not named here
# follows, in name order)
ORDER = (
    "qwen2vl_2b",
    "qwen2vl_2b_multinode",
    "qwen2vl_2b_4gpu_nodes",
    "gemma3_4b",
    "qwen2vl_7b",
    "qwen2vl_7b_multinode",
    "qwen3_vl_8b",
    "gemma3_12b",
    "qwen3_vl_30b_a3b",
    "qwen3_vl_30b_a3b_multinode",
    "qwen3_30b_a3b",
    "gemma4_26b_a4b",
    "qwen2vl_7b_lora",
    "qwen3_vl_8b_dpo",
)


def row(path: Path) -> str:
    """The table row of recipe `path`, from its `# Table:` header line.

    Raises:
      ValueError: no such line, or not four cells, naming the file.
    """
    lines = [x for x in path.read_text().splitlines() if x.startswith("# Table: ")]
    cells = [c.strip() for c in lines[0][len("# Table: ") :].split(" | ")] if lines else []
    if len(lines) != 1 or len(cells) != 4 or not all(cells):
        raise ValueError(
            f"{path}: give the recipe one header line '# Table: model | GPUs | mesh | per GPU "
            "and microbatch' (four cells, none empty)"
        )
    rel = path.relative_to(ROOT).as_posix()
    return f"| `{rel}` | " + " | ".join(cells) + " |\n"


def table() -> str:
    """The whole table, a row per recipe of configs/gpu/."""
    paths = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))
    rank = {name: i for i, name in enumerate(ORDER)}
    paths.sort(key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))
    return HEAD + "".join(row(p) for p in paths)


def render(page: str) -> str:
    """`page` with its table between the markers replaced by `table()`."""
    begin, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:begin] + "\n" + table() + page[end:]  # (END then a blank line, kept)


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text()))
    sys.exit(0)
