"""Benches' tables print every row, a dash where a figure is missing (issue 59)."""

from __future__ import annotations

import pytest

from jaxmllm.bench import attention
from jaxmllm.bench.table import cell, markdown, ratio

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)


def _row(row_len: int) -> dict:
    """An attention bench row past --dense-max: dense compiled for memory only, not timed."""
    return {
        "row_len": row_len,
        "docs": 40,
        "doc_mean": 800.0,
        "fill": 0.98,
        "tiles": 300,
        "doc_tiles": 280,
        "dense_tiles": 32896,
        "sparse_s": 0.25,
        "sparse_bytes": 2**28,
        "dense_bytes": None,
        "dense_measured": False,
        "dense_s": None,
    }


def test_attention_table_prints_rows_without_a_dense_time_to_extrapolate_from():
    # `--rows 32768 --dense-max 8192`: no row short enough to time dense on
    rows = [_row(32768)]
    attention.extrapolate(rows)
    header, _, line = attention.table(rows).splitlines()
    cells = dict(zip(header.split(" | "), line.split(" | "), strict=True))
    assert cells["dense s"] == cells["speed-up"] == cells["dense MiB"] == "-"
    assert cells["sparse s"] == "0.25" and cells["sparse MiB"] == "256"


def test_attention_table_estimates_dense_from_the_longest_measured_row():
    short = _row(8192) | {"dense_measured": True, "dense_s": 1.0, "dense_bytes": 2**30}
    rows = [short, _row(16384)]
    attention.extrapolate(rows)
    lines = attention.table(rows).splitlines()
    assert " | 4 (T^2 est.) | 0.25 | 16.0x | " in lines[3]
    assert " | 1 | 0.25 | 4.0x | 1024 | " in lines[2]


def test_cells_of_missing_figures_are_dashes():
    assert cell(None, ".3f") == "-" and cell(1.5, ".2f", "x") == "1.50x"
    assert cell(3 * 2**20, ".0f", unit=2**20) == "3" and cell(None, ".2f", unit=2**30) == "-"
    assert ratio(None, 2.0) is None and ratio(1.0, 0) is None and ratio(3.0, 2.0) == 1.5
    assert markdown(["a", "b"], [["1", "-"]]) == "a | b\n--- | ---\n1 | -"
