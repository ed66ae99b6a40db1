"""The vectorised text writer of bucketize against the per-sample loop it replaced (kept here
as the oracle): the same arrays, bit for bit, on planned steps of tiny.yaml's synthetic data."""

import numpy as np
import pytest

from jaxmllm.batch.bucketize import bucketize, empty_batch, mrope_positions
from jaxmllm.config import load_config
from jaxmllm.config.phases import VISION
from jaxmllm.data.text.specials import RESERVED
from jaxmllm.resolve.run import resolve_run
from jaxmllm.resolve.sizing import capacities, planner_from_config

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

TEXT = ("llm_tokens", "llm_segment_ids", "llm_positions", "llm_targets", "llm_loss_mask")


def oracle_text(plan, samples, cfg, caps):
    """The per-sample loop bucketize had (no context groups): each sample's text at its row."""
    batch = empty_batch(cfg, caps.devices, pad=RESERVED.pad)
    seg_counter = {}
    for k, s in enumerate(plan.samples.tolist()):
        sample = samples[s]
        if sample is None:
            continue
        m, d, r, o = (int(x[k]) for x in (plan.micro, plan.device, plan.row, plan.offset))
        seg = seg_counter[(m, d, r)] = seg_counter.get((m, d, r), 0) + 1
        n = len(sample.tokens)
        sl = (m, d, r, slice(o, o + n))
        batch["llm_tokens"][sl] = sample.tokens
        batch["llm_segment_ids"][sl] = seg
        if batch["llm_positions"].ndim == 5:
            image = RESERVED.phase_ids(VISION.name)  # (its kinds: images and videos)
            batch["llm_positions"][sl] = mrope_positions(
                sample.tokens, image, sample.grids, cfg.model.vision.merge
            )
        else:
            batch["llm_positions"][sl] = np.arange(n)
        batch["llm_targets"][sl] = np.append(sample.tokens[1:], RESERVED.pad)
        batch["llm_loss_mask"][sl] = np.append(sample.loss[1:], False)
    return batch


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("extra", [[], ["model.llm.mrope_section=[4,6,6]"]], ids=["1d", "mrope"])
def test_text_arrays_match_the_per_sample_loop(devices, extra):
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=256", *extra])
    run = resolve_run(cfg)  # (sized for the mesh's 8 buckets; planned here for `devices`)
    cfg, source, index = run.cfg, run.source, run.index
    caps = capacities(cfg, devices)
    planner = planner_from_config(cfg, index, devices)
    for step in range(3):
        plan = planner.plan()
        samples = {int(i): source[int(i)] for i in np.unique(plan.samples)}
        if step == 2:  # a sample that failed to load keeps its slots padding
            samples[int(plan.samples[0])] = None
        got = bucketize(plan, samples, cfg, caps, index=index)
        want = oracle_text(plan, samples, cfg, caps)
        for key in TEXT:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step} {key}")
        assert (got["llm_segment_ids"] > 0).any()
