"""Rematerialisation policies: what each recomputes (the memory bench's analytic count against
XLA's own), what each keeps (compiled temporaries), and the bench's search for the largest
microbatch that fits. Same math under every policy: tests/test_models.py."""

from __future__ import annotations

import itertools

import jax
import pytest

import sharding
from jaxmllm.batch.bucketize import batch_shapes
from jaxmllm.bench.memory import (
    flops_columns,
    largest_fit,
    layer_flops,
    next_guess,
    recompute_flops,
    with_policy,
)
from jaxmllm.config import MeshConfig, load_config
from jaxmllm.resolve.sizing import resolve_bounds
from jaxmllm.step.program import make_loss_and_grads, model_parts

# The decoder alone (the encoders' blocks are the same code), two layers: a scan XLA keeps,
# whose body its cost analysis counts once.
SMALL = [
    "batch.capacity=fixed",
    "model.audio.enabled=false",
    "model.vision.enabled=false",
    "model.llm.depth=2",
    "batch.microbatches=1",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.cpu_devices=0",
]


def compiled(cfg):
    """The compiled loss and gradients of one microbatch on one device, abstract shapes."""
    mesh = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        parts, _ = model_parts(cfg)
        params, frozen = jax.eval_shape(lambda: _split(parts))
        shapes = batch_shapes(cfg, 1)
        batch = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
        return jax.jit(make_loss_and_grads(parts)).lower(params, frozen, batch).compile()


def _split(parts):
    state = parts.template
    pure = jax.tree.map(lambda x: x, state)
    from flax import nnx

    pure = nnx.to_pure_dict(pure)
    return (
        {k: v for k, v in pure.items() if k not in parts.frozen_keys},
        {k: v for k, v in pure.items() if k in parts.frozen_keys},
    )


@pytest.fixture(scope="module")
def programs():
    base = resolve_bounds(load_config("configs/tiny.yaml", SMALL), 1)
    return {
        p: (with_policy(base, p), compiled(with_policy(base, p)))
        for p in ("none", "full", "save_dots", "save_dots_except_mlp")
    }


def test_the_analytic_recompute_is_what_xla_recomputes(programs):
    """Per layer, against XLA's cost analysis (each policy's FLOPs less `none`'s; it counts a
    scan's body once): save_dots keeps the attention kernel's output and statistics, so its
    backward reruns no matmul (XLA: elementwise ops, 0.08 of the attention; a rerun kernel
    would add the attention itself); the others recompute what the count says within 6% (the
    attention's and norms' elementwise ops, which it leaves out: ~4%)."""
    flops = {p: c.cost_analysis()["flops"] for p, (_, c) in programs.items()}
    count = {p: recompute_flops(cfg) / 2 for p, (cfg, _) in programs.items()}  # (2 layers)
    assert count["none"] == count["save_dots"] == 0
    attention = layer_flops(programs["save_dots"][0], "llm")["attention"]
    assert 0 <= flops["save_dots"] - flops["none"] < 0.5 * attention
    for p in ("full", "save_dots_except_mlp"):
        xla = flops[p] - flops["none"]
        assert count[p] > attention and xla == pytest.approx(count[p], rel=0.06), p


def test_cudnn_attention_kept_by_a_policy_is_not_rerun(monkeypatch):
    """cuDNN's fused kernel (its CPU stand-in) keeps its own residuals tagged: under save_dots
    the backward reruns none of it, under save_qkv all of it (XLA's cost analysis, per layer)."""
    from test_attention import packed_stand_in

    from jaxmllm.models import cudnn

    monkeypatch.setattr(cudnn, "_fused_attention", packed_stand_in)
    cfg = load_config("configs/tiny.yaml", [*SMALL, "model.attention=cudnn"])
    cfg = resolve_bounds(cfg, 1)
    policies = ("none", "save_dots", "save_qkv")
    flops = {p: compiled(with_policy(cfg, p)).cost_analysis()["flops"] for p in policies}
    attention = layer_flops(with_policy(cfg, "none"), "llm")["attention"]
    assert flops["save_dots"] - flops["none"] < 0.5 * attention
    assert flops["save_qkv"] - flops["none"] > attention


def test_the_benchs_recompute_counts_the_sizes_it_compiles():
    """A config with its tiles auto (-1, as configs/small.yaml): the row's count is of the
    bounds the bench compiles, not of -1 tiles (it read a negative attention recompute)."""
    cfg = load_config("configs/tiny.yaml", [*SMALL, "batch.llm_tiles=-1"])
    for policy in ("save_qkv", "full"):  # (both recompute the attention, which tiles size)
        got = flops_columns(with_policy(cfg, policy), 1)
        want = recompute_flops(resolve_bounds(with_policy(cfg, policy), 1))
        assert got["recompute_flops"] == want > 0 and 0 < got["recompute_share"] < 1


def test_each_policy_keeps_less_than_the_one_before(programs):
    temp = {p: c.memory_analysis().temp_size_in_bytes for p, (_, c) in programs.items()}
    assert temp["none"] > temp["save_dots"] > temp["save_dots_except_mlp"] > temp["full"]


def test_the_largest_fit_is_pinned_between_a_count_that_fits_and_the_next():
    """The bench's search from the two counts it compiles first, on made-up peaks: affine (2
    more compiles), then growing faster past a knee (a dozen at most); the exact answer."""
    for knee, c in itertools.product((1, 4, 30, 10**6), (0.02, 1, 3)):
        peak = lambda rows, knee=knee, c=c: 10 + 3 * rows + c * max(rows - knee, 0) ** 2
        for budget in (40, 200, 2000, 20000):
            peaks = {1: peak(1), 2: peak(2)}
            while (guess := next_guess(peaks, budget)) is not None:
                assert guess not in peaks and len(peaks) < 2 + 12, (knee, budget, peaks)
                peaks[guess] = peak(guess)
            want = max(r for r in range(1, 10**4) if peak(r) <= budget)
            assert largest_fit(peaks, budget) == want, (knee, budget)
            assert knee < 10**6 or len(peaks) == 4  # (affine)
    assert largest_fit({1: 50, 2: 80}, 40) == 0  # not even the config's rows fit
