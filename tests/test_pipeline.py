"""Pipeline parallelism on the 8-device CPU mesh: the same loss and gradients as without it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from jaxmllm.batch.bucketize import bucketize
from jaxmllm.config import load_config
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.pipeline.choose import Variants
from jaxmllm.pipeline.partition import Plan, Stage
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.program import make_loss_and_grads
from jaxmllm.step.stages.layout import Layout
from jaxmllm.step.stages.loop import pipeline_loss
from jaxmllm.step.stages.program import build_program

FIXED = [
    "data.synthetic.num_samples=256",
    "batch.capacity=fixed",
    "batch.vision_patches=640",
    "batch.audio_frames=256",
    "batch.route_pair_capacity=160",
    "model.llm.depth=3",
]
TEXT_ONLY = [
    "model.vision.enabled=false",
    "model.audio.enabled=false",
    "data.synthetic.image_fraction=0",
    "data.synthetic.audio_fraction=0",
    "data.synthetic.video_fraction=0",
]


def pipelined_and_reference(*overrides):
    """(loss, grads) of one step's batch through the pipelined program, and through the
    unpipelined step on a mesh of the same data-parallel buckets; grads as [depth, ...]. Also
    the pipelined (loss, grads) of other host batches: run(host)."""
    run = resolve_run(load_config("configs/tiny.yaml", [*FIXED, *overrides]))
    cfg, mesh, devices = run.cfg, run.mesh, run.devices
    host = next(make_pipeline(run, prefetch=0))["batch"]
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = prog.init()
        grads_fn = jax.jit(jax.value_and_grad(pipeline_loss(prog.parts, prog.layout)))

    def run(host):
        with jax.set_mesh(mesh):
            batch = sharding.make_global_batch(host, mesh)
            loss, grads = grads_fn(state["params"], state["frozen"], batch)
            return float(loss), jax.device_get(prog.layout.to_depth(grads))

    got = run(host)
    with jax.set_mesh(mesh):
        params = jax.device_get(prog.weights(state))
    flat = sharding.make_mesh(
        {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp}, devices=jax.devices()[:devices]
    )
    with jax.set_mesh(flat):
        reference = jax.jit(make_loss_and_grads(prog.parts))
        batch = sharding.make_global_batch(host, flat)
        want = jax.device_get(reference(params["params"], params["frozen"], batch))
    return prog, state, got, want, (cfg, host, run)


def assert_same_math(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # two compiles (pipelined and not), ~45 s on a busy 2-core box
def test_text_only_pipeline_of_uneven_stages_with_the_loss_split_over_tensor_matches():
    """2 stages x 2 data-parallel buckets x tensor 2, LLM layers split 1 + 2, the loss split by
    vocabulary over tensor (model.llm.vocab_parallel) inside the stages' shard_map and
    projecting 48 tokens' logits at a time (chunks that do not divide a row: the last one
    padded): the unpipelined step's loss and gradients."""
    prog, _, got, want, _ = pipelined_and_reference(
        *TEXT_ONLY,
        "mesh.stage=2",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=2",
        "model.llm.vocab_parallel=true",
        "pipeline.llm_layers=[1,2]",
        "model.llm.logits_chunk=48",
    )
    assert prog.plan.layers("llm") == (1, 2)
    assert_same_math(got, want)


@pytest.mark.slow  # 2 compiles a case (pipelined and not): 160-210 s on a busy 2-core box
# A step variant (the vision bucket cut) is checked in the first: one more compile. (2 stages x
# 4, a frozen vision encoder data-parallel across the stages, the variant checked there too:
# test_lora's pipeline test, with adapters.)
@pytest.mark.parametrize(
    ("overrides", "variant"),
    [
        # 4 stages x 2: each encoder its own stage (audio frozen, vision trainable), the LLM on 2.
        pytest.param(
            [
                "mesh.stage=4",
                "mesh.data=2",
                "mesh.fsdp=1",
                "model.audio.freeze=true",
                "pipeline.vision=stages",
                "pipeline.audio=stages",
                "model.llm.depth=2",
                "model.llm.logits_chunk=64",
            ],
            True,
            id="stage4-data2-encoder-stages",
        ),
        # 2 stages x 2 x fsdp 2: parameters split over fsdp within each stage, the loss split
        # by vocabulary over fsdp (the embedding lookup takes the gathered table); a trainable
        # audio encoder data-parallel across the stages; M-RoPE positions (time, row, column)
        # ride with the microbatches to the LLM's stages. (A trainable vision encoder in
        # stages of its own: the case above.)
        pytest.param(
            [
                "mesh.stage=2",
                "mesh.data=2",
                "mesh.fsdp=2",
                "model.llm.vocab_parallel=true",
                "model.vision.freeze=true",
                "pipeline.audio=data",
                "model.llm.mrope_section=[4,6,6]",
            ],
            False,
            id="stage2-data2-fsdp2-vocab-mrope",
        ),
        # 4 stages x 2, both encoders frozen: vision's first stage has no backward at all
        # (nothing trainable below it; its projector, on its last stage, still trains).
        pytest.param(
            [
                "mesh.stage=4",
                "mesh.data=2",
                "mesh.fsdp=1",
                "model.vision.freeze=true",
                "model.audio.freeze=true",
                "pipeline.vision=stages",
                "pipeline.audio=data",
            ],
            False,
            id="stage4-data2-frozen-encoders",
        ),
    ],
)
def test_multimodal_pipeline_matches_the_unpipelined_step(overrides, variant):
    prog, state, got, want, (cfg, host, run) = pipelined_and_reference(*overrides)
    assert_same_math(got, want)
    frozen = prog.parts.frozen_keys
    assert bool(frozen) == any("freeze=true" in o for o in overrides)
    assert not set(frozen) & set(state["params"])  # no gradient, no optimizer state
    mirrored = {
        k
        for p in jax.tree_util.tree_leaves_with_path(state["opt_state"])
        for k in map(str, p[0])
        if k.strip(".[]'") in frozen
    }
    assert not mirrored
    if variant:
        assert_a_cut_vision_bucket_changes_nothing(prog, cfg, host, run, want)


def assert_a_cut_vision_bucket_changes_nothing(prog, cfg, host, run, want):
    """A step variant: the vision bucket cut to the whole blocks its images fill drops only
    padding (the same loss and gradients, from a program of other shapes)."""
    fractions = dataclasses.replace(cfg.pipeline, encoder_fractions=(0.0, 1.0))
    variants = Variants(dataclasses.replace(cfg, pipeline=fractions), prog.plan)
    extent = int(np.flatnonzero((host["vision_segment_ids"] > 0).any((0, 1))).max()) + 1
    cut = -(-extent // variants.step["vision"]) * variants.step["vision"]
    assert cut < cfg.batch.vision_patches
    assert_same_math(run(variants._cut_batch(host, "vision", cut)), want)


# --- the layout ---------------------------------------------------------------------------


def test_stage_layout_round_trips_params_and_optimizer_state_with_zero_padding():
    plan = Plan(
        "gpipe",
        4,
        (Stage("vision", 0, 2, None), Stage("llm", 0, 1, None), Stage("llm", 1, 3, None)),
        (),
        None,
        0.0,
        0.0,
    )
    layout = Layout.of(plan)
    rng = np.random.default_rng(0)
    tree = {
        "llm": {"transformer": {"blocks": {"w": rng.normal(size=(4, 3, 2))}}, "embed": np.ones(5)},
        "opt": {"mu": {"vision": {"transformer": {"blocks": {"w": rng.normal(size=(2, 7))}}}}},
        "audio": {"transformer": {"blocks": {"w": np.ones((2, 3))}}},  # not pipelined: as is
    }
    tree = jax.tree.map(lambda a: a.astype(np.float32), tree)
    staged = layout.to_stages(tree)
    w = staged["llm"]["transformer"]["blocks"]["w"]
    assert w.shape == (3, 3, 3, 2)  # [stage, slots = the largest stage's layers, ...]
    np.testing.assert_array_equal(w[0], 0)  # the vision stage holds no LLM layer
    np.testing.assert_array_equal(w[1, 0], tree["llm"]["transformer"]["blocks"]["w"][0])
    np.testing.assert_array_equal(w[1, 1:], 0)  # padding slots
    np.testing.assert_array_equal(w[2], tree["llm"]["transformer"]["blocks"]["w"][1:])
    assert staged["opt"]["mu"]["vision"]["transformer"]["blocks"]["w"].shape == (3, 2, 7)
    assert staged["audio"]["transformer"]["blocks"]["w"].shape == (2, 3)
    back = layout.to_depth(staged)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.asarray(layout.counts("llm")).tolist() == [0, 1, 3]


def test_padding_slots_of_a_stage_are_skipped():
    """A stage's slab holds its layers then padding: `Transformer.layers(count=n)` runs n."""
    from flax import nnx

    from jaxmllm.models.attention import packing
    from jaxmllm.models.transformer import BlockSpec, Transformer

    t = Transformer(3, BlockSpec(16, 2, 2, 32, rope="1d"), rngs=nnx.Rngs(0))
    graphdef, stacked = nnx.split(t)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 16)), jnp.float32)
    pack, pos = packing(jnp.ones((1, 8), jnp.int32), causal=True), jnp.arange(8)[None]

    @jax.jit
    def run(state):
        model = nnx.merge(graphdef, state)
        blocks_def, blocks = nnx.split(model.blocks)
        two = model.layers(x, pack, pos, count=jnp.int32(2))
        model.blocks = nnx.merge(blocks_def, jax.tree.map(lambda a: a[:2], blocks))
        return two, model.layers(x, pack, pos)

    two, first_two = run(stacked)
    np.testing.assert_allclose(two, first_two, rtol=1e-6)
    assert not np.allclose(two, x)


# --- step variants ------------------------------------------------------------------------


def test_variants_cut_only_padding_and_prefer_the_cheapest_that_holds_the_step():
    fractions = "pipeline.encoder_fractions=[0, 0.5, 1]"
    stage2 = ["mesh.stage=2", "mesh.data=4", "mesh.fsdp=1"]
    rare_audio = "data.synthetic.audio_fraction=0.1"  # (some steps have none)
    cfg = load_config("configs/tiny.yaml", [*FIXED, *stage2, fractions, rare_audio])
    run = resolve_run(cfg, 4)
    cfg, source, index = run.cfg, run.source, run.index
    data = make_pipeline(run, prefetch=0)
    variants = data.variants
    assert variants.time[(1.0, 1.0)] > variants.time[(0.5, 1.0)] > variants.time[(0.0, 1.0)]
    seen = set()
    for _ in range(12):
        plan = data.planner.plan()
        samples = {int(i): source[int(i)] for i in plan.samples}
        whole = bucketize(plan, samples, cfg, run.caps, index=index)
        cut, name = variants.pick(plan, index, whole)
        seen.add(name)
        for phase, key in (("vision", "vision_patches"), ("audio", "audio_frames")):
            n = cut[key].shape[2] if key in cut else 0
            assert not (whole[f"{phase}_segment_ids"][:, :, n:] > 0).any()  # only padding cut
            if n:
                np.testing.assert_array_equal(cut[key], whole[key][:, :, :n])
                rows = whole[key].shape[2] // variants.unit[phase]
                src = whole[f"llm_{phase}_src"]
                moved = np.where(src >= rows, src - rows + n // variants.unit[phase], src)
                np.testing.assert_array_equal(cut[f"llm_{phase}_src"], moved)
            else:
                assert f"llm_{phase}_src" not in cut and (whole[f"llm_{phase}_src"] < 0).all()
    assert len(seen) > 1  # the mix varies from step to step
    data.close()
