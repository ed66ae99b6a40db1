"""Mixture-of-experts MLPs (jaxmllm/models/moe.py, grouped.py): the grouped matmul against a
dense reference, expert parallelism against one device, the load-balancing loss against
transformers', the layer segments, and the config's refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.models import grouped, layers, moe
from jaxmllm.models.transformer import Segment, layer_places, segments


def _reference(x, experts, gate, up, down, activation="silu"):
    """Each row through its expert by gathering that expert's weights per row (every row, the
    padding ones' -1 giving 0)."""
    e = jnp.maximum(experts, 0)
    act = layers.ACTIVATIONS[activation]
    h = act(jnp.einsum("rd,rdf->rf", x, gate[e])) * jnp.einsum("rd,rdf->rf", x, up[e])
    return jnp.where((experts >= 0)[:, None], jnp.einsum("rf,rfd->rd", h, down[e]), 0.0)


@pytest.mark.parametrize(
    "sizes, rows, tile, activation",
    [
        ((3, 0, 17, 8, 1), 48, 8, "silu"),  # an empty group, groups across tiles, no expert
        ((16, 16), 32, 16, "silu"),  # groups of whole tiles, every row an expert's
        ((0, 0, 5), 8, 8, "silu"),  # one group, in one tile
        ((1,) * 40, 40, 8, "silu"),  # more groups than tiles: a tile an expert, mostly padding
        ((3, 0, 17, 8, 1), 48, 8, "gelu_tanh"),  # Gemma 4's GeGLU experts
    ],
)
def test_grouped_mlp_computes_each_group_against_its_expert(sizes, rows, tile, activation):
    """Forward and the written-out backward equal a per-row reference (inputs, and every
    expert's gate, up and down), rows in any order, groups empty or cut by tiles, rows of no
    expert (they give 0 and no gradient); the gate SiLU or the tanh GELU."""
    rng = np.random.default_rng(0)
    e, d, f = len(sizes), 16, 24
    x = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((e, d, f),) * 2 + ((e, f, d),)]
    ids = np.repeat(np.arange(e), sizes)
    experts = rng.permutation(np.concatenate([ids, np.full(rows - len(ids), e)]))
    ours = lambda x, *w: grouped.local_experts(x, jnp.asarray(experts), *w, tile, activation)
    ids = jnp.asarray(np.where(experts < e, experts, -1))
    theirs = lambda x, *w: _reference(x, ids, *w, activation)
    np.testing.assert_allclose(ours(x, *w), theirs(x, *w), atol=1e-5)
    cot = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    grad = lambda fn: jax.grad(lambda *a: (fn(*a) * cot).sum(), argnums=(0, 1, 2, 3))(x, *w)
    for a, b in zip(grad(jax.jit(ours)), grad(theirs), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_the_layout_gives_each_expert_whole_tiles_of_its_own():
    """Each row's slot lies in a tile of its expert's, the rows of one expert in their order,
    `row` inverts `slot`; the tiles the groups take are at most the rows' plus one an expert
    (the padding), and the layout holds any loads (every row on one expert too)."""
    rng = np.random.default_rng(2)
    experts, tile = 5, 8
    for ids in (rng.integers(0, experts + 1, 45), np.zeros(45, int), np.full(45, experts)):
        layout = grouped.Layout.of(jnp.asarray(ids), experts, tile, chunk=4)
        slot, row, expert = (np.asarray(a) for a in (layout.slot, layout.row, layout.expert))
        valid = ids < experts
        assert (slot[~valid] >= len(row)).all()
        assert (expert[slot[valid] // tile] == ids[valid]).all()
        assert (row[slot[valid]] == np.flatnonzero(valid)).all()
        assert (np.sort(row[row < len(ids)]) == np.flatnonzero(valid)).all()
        for e in range(experts):  # (a group's rows keep their order, from its first slot)
            mine = slot[ids == e]
            assert (np.diff(mine) == 1).all() and (len(mine) == 0 or mine[0] % tile == 0)
        used = int(layout.used)
        assert used == sum(-(-np.sum(ids == e) // tile) for e in range(experts))
        assert used <= -(-valid.sum() // tile) + experts - 1 <= len(expert)
        assert len(expert) % 4 == 0  # (whole chunks)


# Gemma 4's MoE: GeGLU experts, its router's norm and scales, an ungated shared expert
GEMMA = dict(
    activation="gelu_tanh",
    router_norm=True,
    expert_scale=True,
    shared_mlp_dim=24,
    shared_gate=False,
)


def _layer(experts=8, top_k=2, shared=0, capacity=0.0, width=32, **options):
    spec = moe.MoESpec(
        experts, top_k, 16, norm_topk_prob=True, shared_mlp_dim=shared, capacity_factor=capacity
    )
    layer = moe.MoE(width, dataclasses.replace(spec, **options), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)  # (the scales drawn: ones would hide a misplaced one)
    for scale in (layer.router_scale, layer.expert_scale):
        if scale is not None:
            scale[...] = jnp.asarray(1 + 0.3 * rng.normal(size=scale.shape), jnp.float32)
    return layer


def _inputs(rows=8, tokens=12, width=32):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(rows, tokens, width)), jnp.float32)
    valid = jnp.asarray(rng.random((rows, tokens)) > 0.2)  # (padding tokens reach no expert)
    return x, valid


def _routed(layer, x, valid, mesh=None):
    def loss(state, x):
        y, stats = nnx.merge(graphdef, state).routed(x, valid)
        return (y * y).sum(), (y, stats)

    graphdef, state = nnx.split(layer)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    if mesh is None:
        return fn(state, x)
    with jax.set_mesh(mesh):
        return fn(state, x)


@pytest.mark.parametrize(
    "axes, options",
    [
        ({"expert": 2}, {}),
        ({"expert": 4}, {"shared": 24}),  # (a shared expert beside the routed ones)
        ({"expert": 8}, {}),
        ({"expert": 2, "fsdp": 2, "tensor": 2}, {}),  # experts' width over fsdp and tensor
        ({"expert": 2, "context": 2, "tensor": 2}, {"shared": 24}),  # a row over context
        ({"expert": 4, "tensor": 2}, GEMMA),  # Gemma 4's
    ],
    ids=str,
)
def test_expert_parallelism_computes_what_one_device_does(axes, options):
    """With the experts split over mesh.expert (tokens by all-to-all to their experts'
    devices and back, over the data-parallel buckets; with fsdp, tensor splitting each
    expert's inner width, context), the layer's output, its router statistics and every
    gradient equal one device's; nothing is dropped, and about (expert - 1) / expert of the
    assignments go to another device. Gemma 4's router options and GeGLU experts alike."""
    expert = axes["expert"]
    layer, (x, valid) = _layer(**options), _inputs()
    (_, (y1, s1)), g1 = _routed(layer, x, valid)
    mesh = sharding.make_mesh({"data": -1, **axes})
    (_, (y2, s2)), g2 = _routed(layer, x, valid, mesh)
    np.testing.assert_allclose(y2, y1, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    for key in ("counts", "probs", "tokens", "z"):
        np.testing.assert_allclose(getattr(s2, key), getattr(s1, key), rtol=1e-5)
    assignments = float(valid.sum()) * 2
    assert float(s2.dropped) == 0.0 and float(s1.dropped) == 0.0
    assert float(s1.sent_remote) == 0.0
    share = float(s2.sent_remote) / assignments
    assert abs(share - (expert - 1) / expert) < 0.2, share
    buckets = sharding.data_parallel_size(mesh)
    assert float(s2.recv_mean) * buckets == pytest.approx(assignments)  # (every row received)


def test_a_capacity_drops_what_does_not_fit_and_counts_it():
    """A capacity of 1x the mean a device receives drops the assignments past it: counted
    (the layer's `dropped`), their contribution 0, the others' as dropless."""
    layer, (x, valid) = _layer(capacity=1.0), _inputs()
    mesh = sharding.make_mesh({"data": -1, "expert": 4})
    (_, (y, stats)), _ = _routed(layer, x, valid, mesh)
    free = dataclasses.replace(layer.spec, capacity_factor=0.0)
    layer.spec = free
    (_, (y_free, _)), _ = _routed(layer, x, valid, mesh)
    dropped = float(stats.dropped)
    assert dropped > 0
    changed = np.abs(np.asarray(y) - np.asarray(y_free)).max(-1) > 1e-6
    assert 0 < changed.sum() <= dropped  # (each dropped assignment changes its token only)


@pytest.mark.parametrize("expert", [4, 8])
def test_the_worst_case_reaches_one_device_without_a_drop(expert):
    """Every token of every device routed to the same two experts: the devices holding them
    receive all of their group's (one device: with 2 experts a device; two: with 1, each a token's
    assignment), and the dropless buffer, sized to what a device's experts can be sent
    (min(top_k, experts there) a token a sender), holds it: nothing dropped, one device's
    output."""
    layer, (x, _) = _layer(), _inputs()
    valid = jnp.ones(x.shape[:2], bool)  # (every group of the expert axis as many tokens)
    kernel = np.zeros(layer.router.kernel.shape, np.float32)
    kernel[0, :2] = 1.0  # (feature 0 votes for experts 0 and 1 only)
    layer.router.kernel[...] = jnp.asarray(kernel)
    x = x.at[..., 0].set(5.0)
    (_, (y1, _)), _ = _routed(layer, x, valid)
    mesh = sharding.make_mesh({"data": -1, "expert": expert})
    (_, (y2, stats)), _ = _routed(layer, x, valid, mesh)
    np.testing.assert_allclose(y2, y1, atol=1e-5)
    assert float(stats.dropped) == 0.0
    per_device = 2 if expert == 4 else 1  # (assignments a token sends the busiest device)
    groups = 8 // expert  # (data-parallel groups of the expert axis: each routes its own)
    assert float(stats.recv_max) == float(valid.sum()) / groups * per_device


def test_the_ragged_exchange_lowers():
    """The ragged all-to-all (GPU: XLA:CPU does not run it) traces and lowers with its
    offsets, both ways and in the backward pass."""
    layer, (x, valid) = _layer(), _inputs()
    layer.spec = dataclasses.replace(layer.spec, exchange="ragged")
    graphdef, state = nnx.split(layer)
    mesh = sharding.make_mesh({"data": -1, "expert": 4})

    def loss(state, x):
        return (nnx.merge(graphdef, state).routed(x, valid)[0] ** 2).sum()

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss)).lower(state, x).as_text()
    assert text.count("ragged_all_to_all") >= 4  # (there and back, forward and backward)


def test_the_balance_loss_is_transformers(tmp_path):
    """Our load-balancing loss from the router statistics equals transformers'
    `load_balancing_loss_func` on the same router logits (two layers' tokens concatenated,
    padding left out by its attention mask); the z-loss is the mean squared log-sum-exp."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    experts, top_k, rows, tokens = 8, 2, 2, 10
    logits = rng.normal(size=(2, rows, tokens, experts)).astype(np.float32) * 2
    valid = rng.random((rows, tokens)) > 0.3
    stats = []
    for layer in logits:
        probs = jax.nn.softmax(jnp.asarray(layer), -1)
        _, top = jax.lax.top_k(probs, top_k)
        v = jnp.asarray(valid, jnp.float32)
        counts = jnp.zeros(experts).at[top].add(jnp.broadcast_to(v[..., None], top.shape))
        lse = jax.nn.logsumexp(jnp.asarray(layer), -1)
        zero = jnp.zeros(())
        stats.append(
            moe.RouterStats(
                counts,
                jnp.einsum("bte,bt->e", probs, v),
                v.sum(),
                (lse * lse * v).sum(),
                zero,
                zero,
                zero,
                zero,
            )
        )
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats)
    gate = tuple(torch.from_numpy(layer.reshape(-1, experts)) for layer in logits)
    mask = torch.from_numpy(valid.astype(np.int64))
    theirs = float(load_balancing_loss_func(gate, experts, top_k, mask))
    assert float(moe.balance_loss(stacked)) == pytest.approx(theirs, rel=1e-5)
    lse = jax.nn.logsumexp(jnp.asarray(logits), -1)
    want = float((lse**2 * valid).sum() / (2 * valid.sum()))
    assert float(moe.z_loss(stacked)) == pytest.approx(want, rel=1e-5)


def test_segments_cover_the_layers_with_few_blocks():
    """Layers of one kind: one scan; a period: one scan of the unit; a prefix of another kind:
    two scans; anything else still covers every layer in order."""
    assert segments(["m"] * 48) == (Segment(0, ("m",), 48),)
    assert segments(["d", "m"] * 24) == (Segment(0, ("d", "m"), 24),)
    assert segments(["d"] + ["m"] * 47) == (Segment(0, ("d",), 1), Segment(1, ("m",), 47))
    pattern = list("lllflllflllf")
    assert segments(pattern) == (Segment(0, tuple("lllf"), 3),)
    rng = np.random.default_rng(0)
    for _ in range(20):
        pattern = list(rng.choice(["a", "b", "c"], rng.integers(1, 30)))
        out = [k for s in segments(pattern) for _ in range(s.repeats) for k in s.unit]
        assert out == pattern
    places = layer_places(["d", "m", "m", "d", "m"])  # (the most common kind is `blocks`)
    assert places == [("d_blocks", 0), ("blocks", 0), ("blocks", 1), ("d_blocks", 1), ("blocks", 2)]


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"mesh": {"expert": 2}}, "mesh.expert"),  # a dense decoder
        ({"mesh": {"expert": 3}, "model": {"llm": {"moe": {"experts": 8}}}}, "mesh.expert"),
        ({"mesh": {"stage": 2}, "model": {"llm": {"moe": {"experts": 8}}}}, "mesh.stage"),
        ({"model": {"llm": {"moe": {"experts": 4, "top_k": 5}}}}, "top_k"),
        ({"model": {"llm": {"depth": 2, "moe": {"experts": 4, "dense_layers": [2]}}}}, "dense"),
        ({"model": {"llm": {"depth": 2, "moe": {"experts": 4, "every": 3}}}}, "moe.experts"),
        ({"model": {"llm": {"moe": {"experts": 4, "capacity_factor": 0.5}}}}, "capacity"),
        # (the experts are gated MLPs; Gemma 4's branch norms need its post-norms and the
        # shared expert they norm apart)
        ({"model": {"llm": {"mlp": "gelu", "moe": {"experts": 4}}}}, "llm.mlp"),
        ({"model": {"llm": {"moe": {"experts": 4, "branch_norms": True}}}}, "branch_norms"),
    ],
)
def test_what_a_mixture_of_experts_cannot_run_is_refused_naming_the_key(raw, key):
    raw = {"mesh": {}, **raw}
    llm = raw.setdefault("model", {}).setdefault("llm", {})
    if "moe" in llm:
        llm["moe"].setdefault("mlp_dim", 16)
    with pytest.raises(ConfigError, match=key):
        from_dict(Config, raw)


def test_an_moe_config_counts_its_layers():
    cfg = from_dict(
        Config,
        {
            "model": {
                "llm": {
                    "depth": 6,
                    "moe": {"experts": 4, "mlp_dim": 8, "every": 2, "dense_layers": [3]},
                }
            }
        },
    )
    assert cfg.model.llm.moe_layers == (1, 5)


def test_the_cost_model_and_the_parameter_report_count_the_active_experts():
    """The LLM's FLOPs per token are 2 x its active matmul weights (a token visits top_k of
    the experts: theirs count at top_k / experts), x3 to train; the start-up report's active
    parameters count the same share."""
    import math

    from jaxmllm.config import load_config
    from jaxmllm.cost.model import CostModel
    from jaxmllm.hf.adapter_load import shapes_of
    from jaxmllm.step.program import active_parameters

    cfg = load_config("configs/tiny_moe.yaml")
    moe_cfg = cfg.model.llm.moe
    share = moe_cfg.top_k / moe_cfg.experts
    shapes = shapes_of(cfg)
    matmul = 0.0
    for path, leaf in shapes.items():
        expert = "/mlp/experts/" in path
        if path.startswith("llm/") and (path.endswith("/kernel") or expert):
            matmul += math.prod(leaf.shape) * (share if expert else 1)
    linear = CostModel.from_model(cfg.model).phase("llm").linear
    assert linear == pytest.approx(3 * 2 * matmul)
    total, active = active_parameters(shapes, share)
    experts = sum(math.prod(v.shape) for p, v in shapes.items() if "/mlp/experts/" in p)
    assert total - active == pytest.approx(experts * (1 - share), abs=3)
    assert 0 < active < total


@pytest.mark.slow  # ~55 s on a quiet 2-core box: two runs
def test_the_same_run_logs_the_same_losses_at_any_expert_parallel_degree(tmp_path):
    """configs/tiny_moe.yaml (its LLM alone, text data) trained 3 steps with mesh.expert = 1
    and 4 on 8 CPU devices: the same losses and load-balancing losses step for step (1e-4
    relative); the plans do not change with it, only where experts live and the all-to-alls;
    nothing dropped, and the share of assignments sent to another device's experts is about
    (expert - 1) / expert. (Expert 2, 4 and 8 against one device, the layer alone:
    test_expert_parallelism_computes_what_one_device_does; runs at expert 2: test_hf_moe's
    and test_hf_whole_train's MoE runs.)"""
    import json

    from jaxmllm import train
    from jaxmllm.config import load_config

    text = ["model.vision.enabled=false", "model.audio.enabled=false"]
    text += [f"data.synthetic.{k}_fraction=0" for k in ("image", "audio", "video", "multi_image")]
    rows = {}
    for expert in (1, 4):
        out = tmp_path / f"ep{expert}"
        sets = [*text, f"mesh.expert={expert}", f"mesh.data={4 // expert}", "train.steps=3"]
        sets += ["train.log_every=1", "train.eval_every=0", "data.eval.source=none"]
        sets += [f"train.output_dir={out}", "train.progress_bar=false"]
        train.main(load_config("configs/tiny_moe.yaml", sets))
        lines = (out / "metrics.jsonl").read_text().splitlines()
        rows[expert] = [r for r in map(json.loads, lines) if "loss" in r]
    for expert in (4,):
        for mine, ref in zip(rows[expert], rows[1], strict=True):
            assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4)
            assert mine["moe/aux_loss"] == pytest.approx(ref["moe/aux_loss"], rel=1e-4)
            assert mine["moe/dropped"] == 0.0
            share = mine["moe/sent_remote_share"]
            assert abs(share - (expert - 1) / expert) < 0.15, share
