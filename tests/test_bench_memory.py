"""bench.memory and a preference run's reference policy: the train state a device holds gains a
frozen copy of what trains (`preference.reference: base`), of every parameter (a checkpoint),
or nothing (LoRA and `base`: the adapters are switched off; `precomputed` log-probs), sharded
like the policy, with no optimizer state; the compiled step takes it as an argument (so every
peak counts it), and its forward pass adds no lasting temporaries."""

from __future__ import annotations

import math

import jax
import pytest

import sharding
from jaxmllm.bench.compile import abstract_batch, lower_step
from jaxmllm.bench.memory import reference_line, state_columns, train_flops, with_rows
from jaxmllm.config import load_config
from jaxmllm.resolve.attention import resolve_attention

DPO = "configs/tiny_dpo.yaml"
BASE = ["batch.capacity=fixed", "model.audio.enabled=false"]
FROZEN_VISION = ["model.vision.freeze=true"]  # (frozen: the policy's own, never copied)
LLM_ONLY = ["model.vision.enabled=false"]  # (the compiled checks: a quicker compile)
SFT = ["train.objective=sft"]
LORA = ["model.llm.lora.rank=4"]
PRECOMPUTED = "preference.reference=precomputed"


def sized(overrides: list[str]):
    """The tiny DPO config with `overrides`, sized as bench.memory compiles it, and its mesh."""
    cfg = resolve_attention(load_config(DPO, [*BASE, *overrides]))
    mesh = sharding.make_mesh(cfg.mesh)
    return with_rows(cfg, cfg.batch.llm_rows, sharding.data_parallel_size(mesh)), mesh


def columns(overrides: list[str]) -> dict:
    return state_columns(*sized(overrides))


def state(row: dict) -> int:
    return sum(row["state_device_bytes"].values())


def test_base_holds_a_copy_of_the_trained_parameters_only():
    """DPO's state = SFT's + the reference, which is the trained parameters' bytes (a device's
    shards and in all), not the frozen vision tower's."""
    sft, dpo = columns([*FROZEN_VISION, *SFT]), columns(FROZEN_VISION)
    assert sft["reference"] is None and sft["reference_bytes"] == 0
    assert reference_line(sft) is None
    ref = dpo["reference_device_bytes"]
    assert ref > 0 and state(dpo) - state(sft) == ref
    assert ref == sft["state_device_bytes"]["params"]  # (sharded like them)
    assert sft["state_device_bytes"]["frozen"] > 0  # (the frozen tower: not copied)
    cfg, mesh = sized(FROZEN_VISION)
    with jax.set_mesh(mesh):
        from jaxmllm.step.program import build_program

        trained = build_program(cfg, mesh).abstract["params"]
    leaves = jax.tree.leaves(trained)
    assert dpo["reference_params"] == sum(math.prod(x.shape) for x in leaves)
    assert dpo["reference_bytes"] == sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    assert "copy of the trained parameters" in reference_line(dpo)


def test_lora_with_base_holds_no_copy():
    """Nothing but adapters trains (the recipes' LoRA DPO): no copy. A projector that trains
    whole beside the adapters is copied, alone."""
    adapters = [*FROZEN_VISION, *LORA, "model.projector_freeze=true"]
    sft, dpo = columns([*adapters, *SFT]), columns(adapters)
    assert dpo["reference"] == "base" and dpo["reference_bytes"] == 0
    assert state(dpo) == state(sft)
    assert "no copy held (0 bytes)" in reference_line(dpo)
    sft, dpo = columns([*FROZEN_VISION, *LORA, *SFT]), columns([*FROZEN_VISION, *LORA])
    assert 0 < dpo["reference_device_bytes"] == state(dpo) - state(sft)
    assert dpo["reference_device_bytes"] < sft["state_device_bytes"]["params"]  # (adapters)


def test_a_checkpoint_reference_is_a_copy_of_every_parameter():
    sft = columns([*FROZEN_VISION, *SFT])
    ckpt = columns([*FROZEN_VISION, "preference.reference=/nonexistent-jaxmllm/ckpt"])
    every = sft["state_device_bytes"]["params"] + sft["state_device_bytes"]["frozen"]
    assert ckpt["reference_device_bytes"] == every
    assert state(ckpt) - state(sft) == every
    assert "copy of every parameter" in reference_line(ckpt)


def test_the_reference_forward_counts_once_in_the_step_flops():
    """The LLM trains (x 3), the reference runs it forward once more: 4/3 of SFT's FLOPs."""
    sft, _ = sized([*LLM_ONLY, *SFT])
    dpo, _ = sized(LLM_ONLY)
    assert train_flops(dpo) == pytest.approx(train_flops(sft) * 4 / 3)


def _compiled(overrides: list[str]) -> tuple[dict, int, int]:
    """(memory analysis, a device's batch bytes, a device's reference bytes) of the step."""
    cfg, mesh = sized(overrides)
    _, lowered = lower_step(cfg, mesh)
    memory = lowered.compile().memory_analysis()
    batch = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(abstract_batch(cfg, mesh))
    )
    fields = ("argument", "output", "alias", "temp")
    got = {f: getattr(memory, f"{f}_size_in_bytes") for f in fields}
    return got, batch, state_columns(cfg, mesh)["reference_device_bytes"]


@pytest.mark.slow  # (~16 s: the DPO and SFT steps compiled on 8 devices)
def test_the_compiled_step_holds_the_reference_and_no_lasting_activations_of_it():
    """The step's arguments: DPO's = SFT's + the reference's shards (+ the pair fields of the
    batch); with LoRA and base, only the batch differs. Its forward pass keeps nothing for a
    backward, so the temporaries stay within a few % of SFT's (measured: +0.1%)."""
    sft, sft_batch, _ = _compiled([*LLM_ONLY, *SFT])
    dpo, dpo_batch, ref = _compiled(LLM_ONLY)
    assert ref > 0
    assert dpo["argument"] - sft["argument"] == ref + dpo_batch - sft_batch
    assert dpo["temp"] <= 1.05 * sft["temp"]
    lora_sft, lora_sft_batch, _ = _compiled([*LLM_ONLY, *LORA, *SFT])
    lora, lora_batch, none = _compiled([*LLM_ONLY, *LORA])
    assert none == 0
    assert lora["argument"] - lora_sft["argument"] == lora_batch - lora_sft_batch


def test_precomputed_log_probs_hold_and_run_no_reference():
    sft, pre = columns([*FROZEN_VISION, *SFT]), columns([*FROZEN_VISION, PRECOMPUTED])
    assert pre["reference"] == "precomputed" and pre["reference_bytes"] == 0
    assert state(pre) == state(sft)
    assert "no policy held or run" in reference_line(pre)
    assert train_flops(sized([*LLM_ONLY, PRECOMPUTED])[0]) == train_flops(
        sized([*LLM_ONLY, *SFT])[0]
    )
