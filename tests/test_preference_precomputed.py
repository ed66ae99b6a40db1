"""preference.reference: precomputed: the pass before training gives the losses a reference
held in the step gives, and a finished table is read, never computed again."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmllm.config import load_config
from jaxmllm.train import main

SETS = [
    "data.synthetic.num_samples=96",
    "data.eval.samples=16",
    "data.eval.questions=0",
    "train.steps=3",
    "train.log_every=1",
    "model.init_from.run=",  # (random starting weights: no SFT run needed)
    "preference.sft_weight=0",  # (the DPO term alone: log 2 at the first step)
]


def _losses(out) -> tuple[list[float], dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "eval/loss" in r][-1]


@pytest.mark.slow  # (~1.5 min: two short runs)
def test_precomputed_log_probs_train_as_the_held_reference(tmp_path, caplog):
    held, given = tmp_path / "held", tmp_path / "given"
    main(load_config("configs/tiny_dpo.yaml", [*SETS, f"train.output_dir={held}"]))
    sets = [*SETS, f"train.output_dir={given}", "preference.reference=precomputed"]
    main(load_config("configs/tiny_dpo.yaml", sets))
    (a, eval_a), (b, eval_b) = _losses(held), _losses(given)
    assert a[0] == pytest.approx(np.log(2), abs=1e-6)  # (policy == reference at step 1)
    np.testing.assert_allclose(b, a, rtol=1e-5)
    for key in ("eval/loss", "eval/rewards/margins", "eval/rewards/accuracies"):
        assert eval_b[key] == pytest.approx(eval_a[key], rel=1e-4, abs=1e-6), key
    table = given / "reference_logps"
    assert np.load(table / "train.done.npy").all() and np.load(table / "eval.done.npy").all()
    # a second start (a resumed run's) reads the finished tables: no pass
    caplog.clear()
    main(load_config("configs/tiny_dpo.yaml", [*sets, "train.steps=4"]))
    assert not [r for r in caplog.records if "reference log-probs of" in r.getMessage()]
