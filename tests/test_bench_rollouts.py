"""bench.rollouts: a small GRPO rollout (real ai2d prompts, long-tailed completions) planned
by orchestrated and grain's packer until every completion is planned; its table and JSON."""

from __future__ import annotations

import json

import pytest

from jaxmllm.bench.rollouts import main

POLICIES = ("orchestrated", "grain")


def test_a_small_rollout_is_planned_whole_and_its_figures_are_sane(tmp_path, capsys):
    out = tmp_path / "rollouts.json"
    argv = ["--mix", "ai2d", "--devices", "2", "--prompts", "16", "--group", "4"]
    argv += ["--tokens", "8192", "--max-new", "2048", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "16 prompts x 4 = 64 completions" in text and "goodput" in text
    got = json.loads(out.read_text())
    assert got["prompts"] == 16 and got["group"] == 4
    assert {r["policy"] for r in got["rows"]} == set(POLICIES)
    for r in got["rows"]:
        assert r["mix"] == "ai2d" and r["devices"] == 2 and r["completions"] == 64
        # every completion planned, each counted once: the useful units are the rollout's
        assert r["planned_once"] == 64 and sum(r["new_per_step"]) == 64
        assert len(r["new_per_step"]) == r["steps"] >= 1
        assert r["useful_units"] == pytest.approx(r["rollout_units"])
        assert 0 < r["goodput"] <= r["goodput_packed"] <= 1
        assert all(0 <= f <= 1 for f in r["fill"].values()) and r["fill"]["llm"] > 0
        assert r["repeats"] >= 0 and 0 < r["ms_per_step"] <= r["ms_per_rollout"]
