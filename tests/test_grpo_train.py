"""GRPO end to end on a user's data, as people run it: `hf import --model` of a tiny random
whole checkpoint (a Qwen2.5-VL, a Qwen3.5), a JSONL of image questions with their answers
indexed, two GRPO steps with LoRA (the KL's reference: the same weights, adapters off), the
rewards logged; then `hf export` writes a PEFT adapter that peft loads onto the transformers
model with its logits ours."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_preference_train import LORA, ON_FILES, _images, imported

from jaxmllm import train
from jaxmllm.config import load_config
from jaxmllm.data.index import build_index
from jaxmllm.hf.export import export_run
from jaxmllm.loop.metrics import read_metrics

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

# A random model's answers are never right: a reward that tells its answers apart (their
# length) gives the groups advantages, so the adapters move; exact_answer is logged beside it
REWARDS = (
    "def length(record, completion):\n"
    "    assert record['answer'] in ('red', 'blue', 'green'), record\n"
    "    return len(completion)\n"
)


def questions(d: Path) -> Path:
    """Image questions with their answers, RL's records ({"image", "question", "answer"})."""
    d.mkdir(parents=True, exist_ok=True)
    names = _images(d, np.random.default_rng(0))
    colours = ("red", "blue", "green")
    rows = [
        {"image": name, "question": f"What colour is shape {k}?", "answer": colours[k % 3]}
        for k, name in enumerate(names)
    ]
    path = d / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_5"])
def test_lora_grpo_on_image_questions_logs_rewards_and_exports_an_adapter_peft_loads(
    name, tmp_path, monkeypatch
):
    from test_hf_moe import exported_adapter

    (tmp_path / "rl_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    source, config = imported(name, tmp_path)
    data = questions(tmp_path / "data")
    out = tmp_path / "run"
    cfg = load_config(
        config,
        [
            *ON_FILES,
            f"data.path={data}",
            "train.objective=grpo",
            "rl.prompts_per_step=2",
            "rl.group_size=4",
            "rl.max_new_tokens=8",
            "rl.kl_beta=0.05",
            "rl.rewards=[{name: rl_rewards:length}, {name: exact_answer}]",
            "train.steps=2",
            "train.checkpoint_every=2",
            "train.log_every=1",
            "train.progress_bar=false",
            "optim.lr=1e-2",
            "optim.warmup_steps=0",
            f"train.output_dir={out}",
            *LORA,
        ],
    )
    summary = build_index(cfg, progress=False)
    assert summary["accepted"] == 6 and not summary["rejects"], summary
    train.main(cfg)
    first, second = read_metrics(out)
    assert first["rl/kl"] == pytest.approx(0.0, abs=1e-6)  # (adapters at zero: the reference)
    assert second["rl/kl"] > 0, second  # (the first step moved the policy off it)
    for row in (first, second):
        assert row["rl/reward/exact_answer"] == 0.0 and row["rl/reward/rl_rewards:length"] > 0
        assert row["rl/skipped_prompts"] == 0 and np.isfinite(row["loss"]), row

    adapter = tmp_path / "adapter"
    assert set(export_run(str(out), str(adapter))) == {"model"}
    # (the hybrid's logits within its family's bound, test_hf_qwen35's LoRA export's: its
    # chunked delta rule rounds apart from transformers' in float32; measured 1.08e-4 on
    # logits up to 13 after this run on a 2026-11-28 Xeon with AVX-512, 8e-6 of them)
    bound = 5e-4 if name == "qwen3_5" else 1e-4
    trained, mine = exported_adapter(source, out, adapter, bound)
    moved = [p for p in trained if p.endswith("lora_b")]
    assert moved and any(np.abs(trained[p]).max() > 0 for p in moved)  # (B moved off zero)
    for path, value in trained.items():
        np.testing.assert_allclose(mine[path], value, rtol=1e-6, atol=1e-7, err_msg=path)
