"""On-device orchestration on the 8-device CPU mesh: exact math, one all-to-all, one program."""

import dataclasses

import jax
import numpy as np
import pytest

import sharding
from jaxmllm.batch.bucketize import bucketize
from jaxmllm.config import load_config
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.plan.contract import ItemPlan, StepPlan
from jaxmllm.resolve.run import resolve_run
from jaxmllm.resolve.sizing import capacities, planner_from_config
from jaxmllm.step.program import build_program, make_loss_and_grads, model_parts

ROUTED = [
    "data.synthetic.num_samples=256",
    "batch.capacity=fixed",
    "batch.vision_patches=640",
    "batch.audio_frames=256",
    "batch.route_pair_capacity=160",
    "data.eval.source=none",  # (tiny.yaml's held-out evaluation: not what these test)
]


def resolved(*extra, devices=None):
    return resolve_run(load_config("configs/tiny.yaml", [*ROUTED, *extra]), devices)


def repack(items: ItemPlan, plan: StepPlan, values, ptr) -> None:
    """Recomputes item offsets after their devices changed (items packed in order)."""
    sizes = values[ptr[plan.samples[items.owner]] + items.item]
    micro = plan.micro[items.owner]
    for key in set(zip(micro.tolist(), items.device.tolist(), strict=True)):
        sel = np.flatnonzero((micro == key[0]) & (items.device == key[1]))
        items.offset[sel] = np.cumsum(sizes[sel]) - sizes[sel]


def one_sample_batch(cfg, sample, source, index):
    """The reference layout: one sample alone on one device, no routing."""
    ref = dataclasses.replace(
        cfg,
        batch=dataclasses.replace(
            cfg.batch, microbatches=1, route_pair_capacity=0, planner="first_fit"
        ),
    )
    caps = capacities(ref, 1)

    def items(values, ptr):
        n = int(ptr[sample + 1] - ptr[sample])
        sizes = values[ptr[sample] : ptr[sample + 1]]
        zero = np.zeros(n, np.int64)
        return ItemPlan(owner=zero, item=np.arange(n), device=zero, offset=np.cumsum(sizes) - sizes)

    z = np.zeros(1, np.int64)
    plan = StepPlan(
        step=0,
        samples=np.array([sample]),
        micro=z,
        device=z,
        row=z,
        offset=z,
        items={k: items(v.sizes, v.ptr) for k, v in index.items.items()},
    )
    return ref, bucketize(plan, {sample: source[sample]}, ref, caps)


@pytest.mark.slow  # (~130 s: each of the step's samples alone; CI runs it with -m slow)
def test_routed_step_equals_samples_one_by_one_on_one_device():
    run = resolved()
    cfg, source, index = run.cfg, run.source, run.index
    # The images are moved below, past what the planner balanced: room for every vision tile.
    blocks = cfg.batch.vision_patches // cfg.batch.attention_block
    cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, vision_tiles=blocks**2))
    mesh = sharding.make_mesh(cfg.mesh)
    devices = sharding.data_parallel_size(mesh)
    plan = planner_from_config(cfg, index, devices).plan()
    # Every image goes to another device than its text, and device 0 encodes no image at all.
    owner_dev = plan.device[plan.items["vision"].owner]
    moved = (owner_dev + 1) % devices
    plan.items["vision"].device = np.where(moved == 0, 1, moved)
    repack(plan.items["vision"], plan, index.items["vision"].sizes, index.items["vision"].ptr)
    caps = capacities(cfg, devices)
    samples = {int(s): source[int(s)] for s in plan.samples}
    host = bucketize(plan, samples, cfg, caps)
    assert len(plan.items["vision"].owner) > 10 and (plan.items["vision"].device != owner_dev).all()
    assert not (host["vision_segment_ids"][:, 0] > 0).any()  # device 0 encodes nothing

    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = prog.init()
        routed = jax.jit(make_loss_and_grads(prog.parts))
        loss, grads = routed(
            state["params"], state["frozen"], sharding.make_global_batch(host, mesh)
        )
    params, frozen = jax.device_get((state["params"], state["frozen"]))

    # Reference: each sample alone, unpacked, on one device; combine by loss-token counts.
    ref_cfg, _ = one_sample_batch(cfg, int(plan.samples[0]), source, index)
    reference = jax.jit(make_loss_and_grads(model_parts(ref_cfg)[0]))
    alone = (one_sample_batch(cfg, s, source, index)[1] for s in plan.samples.tolist())
    assert_equals_alone((loss, grads), reference, (params, frozen), alone, host)


def assert_equals_alone(got, reference, state, batches, host, scale: float | None = None) -> None:
    """A step's (loss, grads) against its samples alone: `reference(params, frozen, batch)`
    over each of `batches`, combined by their loss tokens over the step's (`host`); each
    gradient entry by entry, or (`scale`) within `scale` x its tensor's largest |entry|."""
    params, frozen = state
    total = host["llm_loss_mask"].sum()
    want_loss, want_grads = 0.0, jax.tree.map(np.zeros_like, params)
    for batch in batches:
        weight = batch["llm_loss_mask"].sum() / total
        l_s, g_s = jax.device_get(reference(params, frozen, batch))
        want_loss += weight * l_s
        want_grads = jax.tree.map(lambda a, g, w=weight: a + w * g, want_grads, g_s)
    np.testing.assert_allclose(got[0], want_loss, rtol=2e-5)
    flat_got = jax.tree_util.tree_leaves_with_path(jax.device_get(got[1]))
    for (path, grad), want in zip(flat_got, jax.tree.leaves(want_grads), strict=True):
        tol = dict(rtol=2e-4, atol=2e-6)
        if scale is not None:  # (float32's rounding of sums in another order, at its scale)
            tol = dict(rtol=0, atol=scale * np.abs(want).max())
        np.testing.assert_allclose(grad, want, **tol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # ~40 s: 20 train steps (the default suite keeps under 10 minutes)
def test_step_exchanges_by_all_to_all_and_compiles_once_over_20_steps():
    """The step compiles once while each step's mix varies (its sample counts: 10 different in
    these 20 steps, 7 in the first 10)."""
    run = resolved("train.steps=20", "batch.microbatches=1")
    cfg = run.cfg
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = prog.init()
        data = make_pipeline(run)
        first = sharding.make_global_batch(next(data)["batch"], mesh)
        hlo = prog.step.lower(state, first).compile().as_text()
        assert "all-to-all" in hlo
        samples = set()
        for _ in range(20):
            host = next(data)
            samples.add(len(host["info"].samples))
            state, metrics = prog.step(state, sharding.make_global_batch(host["batch"], mesh))
        data.close()
    assert np.isfinite(float(metrics["loss"]))
    assert len(samples) > 3  # the mix really varied from step to step
    assert prog.step._cache_size() == 1


@pytest.mark.parametrize(
    "below",  # (the second case runs with the slow tests: the default suite stays under 10 min)
    ["trainable_projector", pytest.param("nothing_trainable", marks=pytest.mark.slow)],
)
def test_frozen_encoder_costs_match_the_cost_model(below):
    """XLA's FLOP count of the lowered programs: a frozen encoder runs forward only (1x instead
    of 3x)."""
    extra = [
        "model.audio.enabled=false",
        "data.synthetic.audio_fraction=0",
        "batch.planner=first_fit",
        "batch.microbatches=1",  # XLA's cost analysis counts a scan body once
        # Dense attention: its backward is 2x its forward, as the 3x rule assumes; block-sparse
        # attention's backward has more elementwise work per tile in XLA's count (~17% here).
        "model.attention=dense",
    ]
    run = resolved(*extra)
    cfg = run.cfg
    frozen_over = ["model.vision.freeze=true"]
    if below == "nothing_trainable":
        frozen_over.append("model.projector_freeze=true")
    frozen_cfg = resolved(*extra, *frozen_over).cfg
    host = next(make_pipeline(run, prefetch=0))["batch"]

    def flops(fn, *args):
        """Of the program JAX hands XLA, uncompiled (a frozen encoder's backward must be absent
        already there; no compile), or compiled where the platform counts none before it (a
        PJRT plugin's: a GPU). (The parameters are arguments, their shapes only: none is made.)"""
        lowered = fn.lower(*args, host)
        try:
            return lowered.cost_analysis()["flops"]
        except NotImplementedError:
            return lowered.compile().cost_analysis()["flops"]

    def step_flops(c):
        prog_parts = model_parts(c)[0]
        params, frozen = jax.eval_shape(lambda: _split_params(c))
        return flops(jax.jit(make_loss_and_grads(prog_parts)), params, frozen)

    def vision_forward_flops(c):
        prog_parts = model_parts(c)[0]

        def fwd(params, frozen, b):
            model = prog_parts.merge(params, frozen)
            return model.vision(
                b["vision_patches"][0],
                b["vision_segment_ids"][0],
                b["vision_positions"][0],
                b["vision_tiles"][0] if "vision_tiles" in b else None,
            ).sum()

        return flops(jax.jit(fwd), *jax.eval_shape(lambda: _split_params(c)))

    saved = step_flops(cfg) - step_flops(frozen_cfg)
    encoder_fwd = vision_forward_flops(cfg)
    # Trainable: 3x forward (fwd + 2x bwd); frozen: 1x, whether or not something is trained below.
    assert saved == pytest.approx(2 * encoder_fwd, rel=0.1)


def _split_params(cfg):
    from jaxmllm.step.program import build_model

    return build_model(cfg, 0)


def simulate_ragged(operands, outputs, in_off, send, out_off, recv, slices_per_device):
    """The documented semantics of lax.ragged_all_to_all, in numpy, over all devices at once."""
    results = [o.copy() for o in outputs]
    for src, operand in enumerate(operands):
        for i in range(len(in_off[src])):
            dst, n = i // slices_per_device, int(send[src][i])
            assert recv[dst][src * slices_per_device + i % slices_per_device] == n
            chunk = operand[in_off[src][i] : in_off[src][i] + n]
            results[dst][out_off[src][i] : out_off[src][i] + n] = chunk
    return results


def test_ragged_exchange_arguments_reproduce_the_dense_exchange():
    from jaxmllm.models.mllm import exchange_rows, ragged_args

    rng = np.random.default_rng(0)
    devices, caps, width = 4, [3, 2], 5
    rows = [rng.normal(size=(devices, 7, width)).astype(np.float32) for _ in caps]
    sends = [rng.integers(0, 7, (devices, devices, c)).astype(np.int32) for c in caps]
    counts = [rng.integers(0, c + 1, (devices, devices)).astype(np.int32) for c in caps]
    dense = [np.asarray(x) for x in exchange_rows(rows, sends)]  # [D, D*C_p, W] per phase

    # What each device would send: the dense send buffer [D, sum C_p, W], flattened.
    operands = [
        np.concatenate([r[s][sd[s]] for r, sd in zip(rows, sends, strict=True)], axis=1).reshape(
            -1, width
        )
        for s in range(devices)
    ]
    args = [
        [np.asarray(a) for a in ragged_args(s, [c[s] for c in counts], caps)]
        for s in range(devices)
    ]
    in_off, send, out_off = zip(*args, strict=True)
    recv = [
        np.concatenate([send[s][d * 2 : d * 2 + 2] for s in range(devices)]) for d in range(devices)
    ]  # what the all-to-all of sizes delivers
    got = simulate_ragged(
        operands,
        [np.zeros_like(o) for o in operands],
        in_off,
        send,
        out_off,
        recv,
        slices_per_device=len(caps),
    )
    total, offsets = sum(caps), [0, caps[0]]
    for d in range(devices):
        for s in range(devices):
            for p, c_p in enumerate(caps):
                n = counts[p][s, d]
                start = s * total + offsets[p]
                want = dense[p][d].reshape(devices, c_p, width)[s, :n]
                np.testing.assert_array_equal(got[d][start : start + n], want)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is XLA:CPU's")
def test_ragged_exchange_lowers_in_the_step_and_is_refused_on_cpu(tmp_path):
    from jaxmllm.config import ConfigError
    from jaxmllm.train import main

    run = resolved("batch.exchange=ragged", "batch.microbatches=1", devices=8)  # (lowered)
    cfg = run.cfg
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = jax.eval_shape(prog.init)
        host = next(make_pipeline(run, prefetch=0))["batch"]
        text = prog.step.lower(state, sharding.make_global_batch(host, mesh)).as_text()
    assert text.count("ragged_all_to_all") >= 2  # the exchange and its transpose (backward)
    assert "vision_send_count" in host and host["vision_send_count"].sum() > 0
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"batch\.exchange: dense on CPU"):
        main(bad)


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="XLA:CPU has no ragged_all_to_all (on a GPU: JAX_PLATFORMS=cuda pytest -n 0 ...)",
)
def test_ragged_exchange_on_gpu_moves_the_filled_slots_and_transposes():
    """On every GPU there is: the ragged exchange delivers each (source, phase)'s filled prefix
    where the dense all-to-all puts it, and its transpose (the backward pass) brings the
    gradient back to exactly those slots."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxmllm.models.mllm import _ragged_exchange

    rng = np.random.default_rng(0)
    devices, caps, width = jax.device_count(), [3, 2], 5
    total, offsets = sum(caps), [0, caps[0]]
    mesh = jax.make_mesh((devices,), ("data",))
    sent = rng.normal(size=(devices, devices, total, width)).astype(np.float32)  # [src, dst]
    counts = [rng.integers(0, c + 1, (devices, devices)).astype(np.int32) for c in caps]
    counts[0][0, 0] = caps[0]  # a full phase chunk
    weights = rng.normal(size=(devices, devices, total, width)).astype(np.float32)
    on_devices = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))

    def exchange(sent_sdcw, *counts_sd):
        body = lambda s, *c: _ragged_exchange(s[0], [x[0] for x in c], caps, ("data",))[None]
        spec = PartitionSpec("data")
        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(sent_sdcw, *counts_sd)

    sent_d, counts_d = on_devices(sent), [on_devices(c) for c in counts]
    got = np.asarray(jax.jit(exchange)(sent_d, *counts_d))  # [dst, src * total + slot, W]
    w_d = on_devices(weights.reshape(got.shape))
    loss = lambda s: jax.numpy.sum(exchange(s, *counts_d) * w_d)
    grad = np.asarray(jax.jit(jax.grad(loss))(sent_d))
    got = got.reshape(devices, devices, total, width)
    w = weights.reshape(devices, devices, total, width)
    for d in range(devices):
        for s in range(devices):
            filled = np.zeros(total, bool)
            for p in range(len(caps)):
                n = int(counts[p][s, d])
                sl = slice(offsets[p], offsets[p] + n)
                np.testing.assert_array_equal(got[d, s, sl], sent[s, d, sl])
                filled[sl] = True
            np.testing.assert_array_equal(grad[s, d][filled], w[d, s][filled])
            assert not grad[s, d][~filled].any(), "unfilled slots get no gradient"
