"""bench.rollouts: a small GRPO rollout (real ai2d prompts, long-tailed completions) planned
by orchestrated and grain's packer until every completion is planned; its table and JSON."""

from __future__ import annotations

import json

import pytest

from jaxmllm.bench.rollouts import main

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

POLICIES = ("orchestrated", "grain")


def test_a_small_rollout_is_planned_whole_and_its_figures_are_sane(tmp_path, capsys):
    """Grouped (a prompt's completions one sample, its media once: the trainer's layout) and a
    completion each, at the same capacities: every sample planned once, the same LLM tokens,
    and the groups' vision work the prompts' images once a sample, at most half the
    completions' copies (G = 4; rows of 4,608 tokens: a group that overruns a bucket is split,
    each part encoding the images again, so there are more samples than prompts)."""
    out = tmp_path / "rollouts.json"
    argv = ["--mix", "ai2d", "--devices", "2", "--prompts", "16", "--group", "4"]
    argv += ["--tokens", "4096", "--max-new", "2048", "--json", str(out)]
    units = {}
    for layout, extra in (("grouped", []), ("per_completion", ["--per-completion"])):
        assert main(argv + extra) == 0
        text = capsys.readouterr().out
        assert "16 prompts x 4 = 64 completions" in text and "goodput" in text
        got = json.loads(out.read_text())
        assert got["prompts"] == 16 and got["group"] == 4 and got["layout"] == layout
        assert {r["policy"] for r in got["rows"]} == set(POLICIES)
        for r in got["rows"]:
            n = r["samples"]
            assert r["mix"] == "ai2d" and r["devices"] == 2
            assert n == 64 if layout == "per_completion" else 16 < n < 64
            # every sample planned, each counted once: the useful units are the rollout's
            assert r["planned_once"] == n and sum(r["new_per_step"]) == n
            assert len(r["new_per_step"]) == r["steps"] >= 1
            assert r["useful_units"] == pytest.approx(r["rollout_units"])
            assert 0 < r["goodput"] <= r["goodput_packed"] <= 1
            assert all(0 <= f <= 1 for f in r["fill"].values()) and r["fill"]["llm"] > 0
            assert r["repeats"] >= 0 and 0 < r["ms_per_step"] <= r["ms_per_rollout"]
            units[layout, r["policy"]] = r["rollout_units"]
    for policy in POLICIES:
        grouped, each = units["grouped", policy], units["per_completion", policy]
        assert grouped["llm"] == each["llm"]  # (every document holds its image's slots)
        assert 0 < 2 * grouped["vision"] <= each["vision"]
