"""A host's start-up on a large mapped index keeps the index's pages out of its resident memory
(issue 50): the summary's pass reads the columns in windows from their files, and a gather
from a large mapped column (the planner's every step, the summary's tail) releases the pages
it mapped. The figures at 10^6-10^8 samples: `python -m jaxmllm.bench.startup --sizes ...`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmllm.bench.lengths_synth import write
from jaxmllm.data import columnar
from jaxmllm.data.columnar import Column, open_column
from jaxmllm.data.stored import StoredIndex
from jaxmllm.plan import summary as summaries

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)


def file_pages_mb() -> float:
    """This process's resident pages of mapped files (RssFile), in MB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssFile:"))
    return int(line.split()[1]) / 1024


def column(tmp_path, values: np.ndarray) -> np.ndarray:
    np.save(tmp_path / "c.npy", values)
    table = {"c.npy": [values.dtype.str, list(values.shape)]}
    return open_column(tmp_path, "c.npy", table)


@pytest.mark.parametrize("shape", [(4_000_000,), (2_000_000, 2)])
def test_a_gather_from_a_large_mapped_column_leaves_its_pages_out(tmp_path, monkeypatch, shape):
    """20,000 rows scattered over a 32 MB column: read through a plain mapping they bring
    most of it into resident memory (64 KB around each); a Column's gather releases them."""
    monkeypatch.setattr(columnar, "GATHER_BLOCK", 1 << 20)
    values = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    col = column(tmp_path, values)
    assert isinstance(col, Column)
    rows = np.random.default_rng(0).integers(-len(values), len(values), 20_000)
    before = file_pages_mb()
    got = col[rows]
    assert file_pages_mb() - before < 4  # (a plain mapping: ~30 MB)
    assert np.array_equal(got, values[rows]) and type(got) is np.ndarray
    assert np.array_equal(col[rows.reshape(100, 200)], values[rows.reshape(100, 200)])
    assert np.array_equal(col[[3, 1, 3]], values[[3, 1, 3]]) and int(col[5].ravel()[0]) >= 0


def test_the_summary_pass_keeps_no_page_of_the_index(tmp_path, monkeypatch):
    """The summary (sizing reads it) of a mapped 2 * 10^6-sample index: one pass over every
    column and a sample of it. It read the columns through their mappings, so a 10^8-sample
    index's first plan held 4 GB of them; now the pass reads windows from the files."""
    monkeypatch.setattr(columnar, "GATHER_BLOCK", 1 << 20)
    write(tmp_path / "index", 2_000_000)
    summary = json.loads((tmp_path / "index" / "summary.json").read_text())
    index = StoredIndex(tmp_path / "index", summary, lengths_only=True).lengths()
    before = file_pages_mb()
    got = summaries.summarize(index, {"vision": 4, "audio": 4})
    assert file_pages_mb() - before < 8  # (the columns are 80 MB)
    assert got.samples == len(index) and len(got.body) == summaries.SAMPLE
    want = summaries.subset(index, got.body_ids)  # (the sample, gathered another way)
    assert np.array_equal(got.body.text, want.text)
    for phase, items in got.body.items.items():
        assert np.array_equal(items.ptr, want.items[phase].ptr)
        assert np.array_equal(items.sizes, want.items[phase].sizes)
    assert got.most["llm"] == int(index.llm_tokens({"vision": 4, "audio": 4}).max())
