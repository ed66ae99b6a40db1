"""Tests for sharding/: mesh, rules, parameter/optimizer/batch shardings on 8 CPU devices."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec

import sharding
from sharding import RULES, ShardingError

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
)

F32 = jnp.float32


def llm_axes():
    """A small Llama-like axes tree with every kind of kernel the models use; the blocks are
    stacked (scanned) on a leading "layers" dim, like the models'."""
    blocks = {
        "attn": {
            "q": ("layers", "embed", "heads", "head_dim"),
            "k": ("layers", "embed", "kv_heads", "head_dim"),
            "o": ("layers", "heads", "head_dim", "embed"),
        },
        "mlp": {"wi": ("layers", "embed", "mlp"), "wo": ("layers", "mlp", "embed")},
        "norm": ("layers", "embed"),
    }
    return {
        "llm": {"embed": ("vocab", "embed"), "blocks": blocks, "scale": None},
        "vision": {"patch_in": ("patch", "embed"), "mel_in": ("mel", "embed")},
    }


def llm_params():
    """Abstract params matching ``llm_axes`` (layers=3, heads=4, kv_heads=2, embed=16, mlp=32)."""
    sd = jax.ShapeDtypeStruct
    blocks = {
        "attn": {
            "q": sd((3, 16, 4, 8), F32),
            "k": sd((3, 16, 2, 8), F32),
            "o": sd((3, 4, 8, 16), F32),
        },
        "mlp": {"wi": sd((3, 16, 32), F32), "wo": sd((3, 32, 16), jnp.bfloat16)},
        "norm": sd((3, 16), F32),
    }
    return {
        "llm": {"embed": sd((64, 16), F32), "blocks": blocks, "scale": sd((), F32)},
        "vision": {"patch_in": sd((12, 16), F32), "mel_in": sd((6, 16), F32)},
    }


# --- mesh -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, shape",
    [
        ({"data": -1, "fsdp": 2, "tensor": 1}, (4, 1, 1, 2, 1, 1)),
        ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 1, 1, 2, 1, 2)),
        ({"data": 1, "fsdp": -1, "tensor": 2}, (1, 1, 1, 4, 1, 2)),
        ({"data": 2, "context": 4}, (2, 1, 1, 1, 4, 1)),
        ({"data": 1, "context": -1}, (1, 1, 1, 1, 8, 1)),
        ({"data": 2, "stage": 4}, (2, 4, 1, 1, 1, 1)),
        ({"stage": 2, "fsdp": 2}, (2, 2, 1, 2, 1, 1)),
        ({"expert": 4, "fsdp": 2}, (1, 1, 4, 2, 1, 1)),
        ({"data": 2, "expert": -1}, (2, 1, 4, 1, 1, 1)),
        ({}, (8, 1, 1, 1, 1, 1)),  # MeshConfig defaults: data=-1
    ],
)
def test_make_mesh_shapes(cfg, shape):
    mesh = sharding.make_mesh(cfg)
    assert mesh.axis_names == ("data", "stage", "expert", "fsdp", "context", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert mesh.axis_types == (AxisType.Auto,) * 6
    # a batch's device buckets: every device but the tensor groups' copies and the stages (the
    # expert axis holds buckets of its own: EP inside DP)
    assert sharding.data_parallel_size(mesh) == shape[0] * shape[2] * shape[3] * shape[4]
    assert sharding.context_size(mesh) == shape[4]
    assert sharding.expert_size(mesh) == shape[2]


def test_make_mesh_accepts_config_object():
    mesh = sharding.make_mesh(SimpleNamespace(data=4, fsdp=2, tensor=1))
    want = {"data": 4, "stage": 1, "expert": 1, "fsdp": 2, "context": 1, "tensor": 1}
    assert dict(mesh.shape) == want


def test_make_mesh_on_given_devices():
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:4])
    assert mesh.shape["data"] == 4


def _device(host: int | None, process: int, number: int) -> SimpleNamespace:
    kw = {} if host is None else {"slice_index": host}
    return SimpleNamespace(process_index=process, id=number, **kw)


@pytest.mark.parametrize(
    ("per_host", "per_process", "shape", "spans"),
    [
        (8, 1, (2, 1, 1, 8, 1, 1), False),  # SLURM: one process a GPU, fsdp over a node's 8
        (8, 8, (2, 1, 1, 8, 1, 1), False),  # one process driving a node's 8 GPUs
        (4, 1, (1, 1, 1, 8, 1, 1), True),  # fsdp 8 over two 4-GPU nodes: the real mistake
        (4, 1, (2, 1, 1, 2, 1, 2), False),  # fsdp x tensor = 4 on 4-GPU nodes
        (4, 4, (1, 1, 2, 4, 1, 1), True),  # expert x fsdp = 8 on 4-GPU nodes
    ],
)
def test_groups_spanning_hosts_are_counted_over_the_jobs_hosts(per_host, per_process, shape, spans):
    """The check reads the job's hosts (XLA's slice_index: processes of one machine alike),
    not one process's devices: a one-process-per-GPU job over 8-GPU nodes keeps its fsdp 8
    groups on one node each, and says nothing."""
    devices = [_device(k // per_host, k // per_process, k) for k in range(16)]
    problem = sharding.mesh.spans_hosts(devices, shape)
    assert bool(problem) == spans, problem
    if spans:
        assert f"have {per_host} devices each" in problem and "span hosts" in problem


def test_without_a_host_number_each_process_is_a_host():
    devices = [_device(None, k // 4, k) for k in range(8)]  # (a backend with no slice_index)
    assert sharding.mesh.spans_hosts(devices, (2, 1, 1, 4, 1, 1)) == ""
    assert "span hosts" in sharding.mesh.spans_hosts(devices, (1, 1, 1, 8, 1, 1))


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"data": -1, "fsdp": -1}, ["mesh.data", "mesh.fsdp", "at most one"]),
        ({"data": 3, "fsdp": 2, "tensor": 1}, ["mesh.data=3", "mesh.fsdp=2", "8 devices"]),
        ({"data": -1, "fsdp": 3}, ["mesh.fsdp=3", "8 devices"]),
        ({"data": 8, "tensor": 0}, ["mesh.tensor=0"]),
    ],
)
def test_make_mesh_errors_name_keys_and_device_count(cfg, words):
    with pytest.raises(ShardingError) as err:
        sharding.make_mesh(cfg)
    assert isinstance(err.value, ValueError)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "cfg, devices",
    [({"data": -1, "expert": 2}, 1), ({"data": -1, "expert": 2}, 3), ({"data": 2, "fsdp": 2}, 1)],
)
def test_a_mesh_larger_than_the_cpu_names_mesh_cpu_devices(cfg, devices):
    # `--set mesh.expert=2` on a CPU that is one device: the fix is mesh.cpu_devices
    with pytest.raises(ShardingError) as err:
        sharding.make_mesh(cfg, devices=jax.devices()[:devices])
    need = 2 if cfg.get("data") == -1 else 4
    assert f"mesh.cpu_devices: {need}" in str(err.value)
    with pytest.raises(ShardingError) as err:  # (elsewhere more devices are not a key away)
        sharding.mesh.resolve_axis_sizes(cfg, devices)
    assert "cpu_devices" not in str(err.value)


# --- rules ------------------------------------------------------------------------------------


def test_logical_to_spec_default_rules():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    spec = sharding.logical_to_spec(("embed", "heads", "head_dim"), (16, 4, 8), mesh)
    assert spec == PartitionSpec("fsdp", "tensor", None)
    spec = sharding.logical_to_spec(("batch", None), (8, 5), mesh)  # (axes of size 1 left out)
    assert spec == PartitionSpec(("data", "fsdp"), None)
    mesh = sharding.make_mesh({"expert": 4, "fsdp": 2})  # experts over expert, width over fsdp
    spec = sharding.logical_to_spec(("expert", "expert_embed", "mlp"), (8, 16, 4), mesh)
    assert spec == PartitionSpec("expert", "fsdp", "tensor")
    # every other weight's width over both (ZeRO-3 over the expert axis's buckets too)
    spec = sharding.logical_to_spec(("embed", "heads"), (16, 4), mesh)
    assert spec == PartitionSpec(("expert", "fsdp"), "tensor")


def test_indivisible_dim_is_replicated_with_a_note():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    spec, notes = sharding.resolve(("heads", "embed"), (6, 16), mesh)
    assert spec == PartitionSpec(None, "fsdp")
    assert notes == ("dim 0 (heads) replicated: 6 % 4 != 0 (tensor=4)",)


def test_unknown_logical_name_lists_known_names():
    mesh = sharding.make_mesh({})
    with pytest.raises(ShardingError, match="unknown logical axis 'hidden'.*embed"):
        sharding.logical_to_spec(("hidden",), (8,), mesh, path="llm/w")


def test_axes_length_must_match_ndim():
    mesh = sharding.make_mesh({})
    with pytest.raises(ShardingError, match="llm/w: 1 logical axes"):
        sharding.logical_to_spec(("embed",), (8, 8), mesh, path="llm/w")


def test_duplicate_mesh_axis_in_spec_names_path_and_axis():
    with pytest.raises(ShardingError, match="llm/w: mesh axis 'fsdp'.*dim 0 and dim 2"):
        sharding.check_no_duplicate_axes("llm/w", PartitionSpec("fsdp", None, ("data", "fsdp")))
    sharding.check_no_duplicate_axes("llm/w", PartitionSpec("fsdp", "tensor", None))


MODELS = ("tiny", "tiny_moe", "tiny_hybrid")  # dense, mixture of experts, linear attention


@pytest.fixture(scope="module")
def model_axes() -> dict[str, dict]:
    """The logical axes of every parameter of the tiny configs' models, towers included."""
    from jaxmllm.config import load_config
    from jaxmllm.step.program import model_parts

    sets = ["batch.route_pair_capacity=80"]
    return {m: model_parts(load_config(f"configs/{m}.yaml", sets))[1] for m in MODELS}


def test_default_rules_pass_the_models_axes_trees(model_axes):
    """The default table against the axes the models name: every name has a rule, no array
    puts two dims on one mesh axis, and the trees hold the width names the rules shard (a tree
    of replicated names would pass any table). The same MoE tree fails a table that puts the
    experts' width where the dense width goes (on the expert axis, beside the experts)."""
    sharded, used = {"embed", "mlp", "heads", "kv_heads"}, {}
    for model, axes in model_axes.items():
        sharding.validate(axes, RULES)
        leaves = sharding.rules.axes_leaves(axes)
        used[model] = {name for names in leaves.values() for name in names or () if name}
        assert used[model] <= set(RULES) and sharded <= used[model], (model, used[model])
        for path, names in leaves.items():
            on = [a for n in names or () for a in sharding.rules.mesh_axes_of(n, RULES, path)]
            assert len(on) == len(set(on)), (model, path, names)
    assert {"expert", "expert_embed"} <= used["tiny_moe"]
    bad = {**RULES, "expert_embed": RULES["embed"]}
    with pytest.raises(ShardingError, match="mesh axis 'expert'"):
        sharding.validate(model_axes["tiny_moe"], bad)


def test_rules_mapping_two_dims_to_one_axis_fail_at_validate():
    bad = {**RULES, "mlp": "fsdp"}
    with pytest.raises(ShardingError) as err:
        sharding.validate(llm_axes(), bad)
    message = str(err.value)
    assert "llm/blocks/mlp/wi" in message and "'fsdp'" in message
    assert "change the rule for 'mlp'" in message


def test_duplicate_fails_even_when_the_dim_would_be_replicated():
    # validate is shape-free: a bad table fails whatever the sizes happen to be.
    bad = {**RULES, "mlp": "fsdp"}
    mesh = sharding.make_mesh({"data": 1, "fsdp": 8})
    params = {"w": jax.ShapeDtypeStruct((16, 6), F32)}
    with pytest.raises(ShardingError, match="w: mesh axis 'fsdp'"):
        sharding.param_shardings({"w": ("embed", "mlp")}, params, mesh, bad)


def test_same_logical_name_twice_asks_for_another_name():
    with pytest.raises(ShardingError, match="both logical 'embed'.*another logical name"):
        sharding.validate({"proj": ("embed", "embed")})


@pytest.mark.parametrize("rule", ["model", ("fsdp", "fsdp"), ["fsdp"]])
def test_malformed_rule_is_rejected(rule):
    with pytest.raises(ShardingError, match="rule 'embed'"):
        sharding.validate({"w": ("embed",)}, {**RULES, "embed": rule})


# --- params -----------------------------------------------------------------------------------


def test_param_shardings_place_arrays_with_expected_local_shapes():
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    shardings = sharding.param_shardings(llm_axes(), llm_params(), mesh)
    assert shardings["llm"]["blocks"]["mlp"]["wo"].spec == PartitionSpec(None, "tensor", "fsdp")
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), llm_params())
    placed = jax.device_put(params, shardings)
    local = lambda x: x.addressable_shards[0].data.shape
    assert local(placed["llm"]["embed"]) == (64, 8)
    assert local(placed["llm"]["blocks"]["attn"]["q"]) == (3, 8, 4, 8)  # every layer, 1/2 each
    assert local(placed["llm"]["blocks"]["mlp"]["wi"]) == (3, 8, 32)
    assert local(placed["llm"]["scale"]) == ()
    assert local(placed["vision"]["mel_in"]) == (6, 8)


def test_param_shardings_on_3d_mesh():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.param_shardings(llm_axes(), llm_params(), mesh)
    q = shardings["llm"]["blocks"]["attn"]["q"]
    assert q.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert q.shard_shape((3, 16, 4, 8)) == (3, 8, 2, 8)


def test_param_shardings_reject_mismatched_trees():
    mesh = sharding.make_mesh({})
    params = {"a": jax.ShapeDtypeStruct((4,), F32), "b": jax.ShapeDtypeStruct((4,), F32)}
    with pytest.raises(ShardingError, match=r"params without axes \['b'\]"):
        sharding.param_shardings({"a": ("embed",)}, params, mesh)


def adamw_chain():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, mask=decay_mask))


def test_opt_state_shardings_follow_params_and_jit_init():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    p_shard = sharding.param_shardings(llm_axes(), llm_params(), mesh)
    optimizer = adamw_chain()
    abstract_state = jax.eval_shape(optimizer.init, llm_params())
    o_shard = sharding.opt_state_shardings(optimizer, abstract_state, p_shard, mesh)
    adam = o_shard[1][0]
    assert adam.mu == p_shard and adam.nu == p_shard
    assert adam.count.spec == PartitionSpec()
    params = jax.device_put(
        jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), llm_params()), p_shard
    )
    state = jax.jit(optimizer.init, out_shardings=o_shard)(params)
    assert state[1][0].mu["llm"]["embed"].sharding == p_shard["llm"]["embed"]


def test_opt_state_shardings_with_a_frozen_subtree():
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2})
    p_shard = sharding.param_shardings(llm_axes(), llm_params(), mesh)
    labels = {"llm": "train", "vision": "freeze"}
    optimizer = optax.multi_transform(
        {"train": adamw_chain(), "freeze": optax.set_to_zero()},
        lambda params: {k: labels[k] for k in params},
    )
    abstract_state = jax.eval_shape(optimizer.init, llm_params())
    o_shard = sharding.opt_state_shardings(optimizer, abstract_state, p_shard, mesh)
    mu = o_shard.inner_states["train"].inner_state[1][0].mu
    assert isinstance(mu["vision"], optax.MaskedNode)
    assert mu["llm"] == p_shard["llm"]
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), llm_params())
    jax.jit(optimizer.init, out_shardings=o_shard)(params)


def test_opt_state_shardings_for_gradient_accumulation_and_factored_state():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    p_shard = sharding.param_shardings(llm_axes(), llm_params(), mesh)
    optimizer = optax.MultiSteps(optax.adafactor(1e-3, min_dim_size_to_factor=8), 4)
    abstract_state = jax.eval_shape(optimizer.init, llm_params())
    o_shard = sharding.opt_state_shardings(optimizer, abstract_state, p_shard, mesh)
    assert o_shard.acc_grads == p_shard
    assert o_shard.mini_step.spec == PartitionSpec()
    v_row = o_shard.inner_opt_state[0].v_row["llm"]["blocks"]["mlp"]["wi"]
    assert v_row.spec == PartitionSpec()  # factored (3, 16) row stats: the 3-D spec does not fit
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), llm_params())
    jax.jit(optimizer.init, out_shardings=o_shard)(params)


def test_describe_lists_every_parameter_and_totals():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    text = sharding.describe(llm_axes(), llm_params(), mesh)
    for path in (
        "llm/embed",
        "llm/blocks/attn/q",
        "llm/blocks/mlp/wo",
        "llm/scale",
        "vision/mel_in",
    ):
        assert path in text
    assert "P(None, fsdp, tensor, None)" in text  # attn/q
    assert "replicated: 2 % 4 != 0" in text  # kv_heads=2 on tensor=4
    assert "10 arrays" in text and "per device" in text


# --- batches ----------------------------------------------------------------------------------


def test_batch_sharding_splits_the_device_axis():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    axes = ("data", "expert", "fsdp", "context")
    assert sharding.batch_sharding(mesh, 3).spec == PartitionSpec(None, axes, None)
    assert sharding.batch_sharding(mesh, 2, device_axis=0).spec == PartitionSpec(axes, None)
    with pytest.raises(ShardingError):
        sharding.batch_sharding(mesh, 1)


def test_make_global_batch_round_trips():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    host = {
        "tokens": np.arange(2 * 8 * 5, dtype=np.int32).reshape(2, 8, 5),
        "mask": np.ones((2, 4), bool),
    }
    batch = sharding.make_global_batch(host, mesh)
    assert batch["tokens"].shape == (2, 8, 5) and batch["mask"].shape == (2, 4)
    assert batch["tokens"].sharding == sharding.batch_sharding(mesh, 3)
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), host["tokens"])
    shard = batch["tokens"].addressable_shards[0]
    assert shard.data.shape == (2, 2, 5)  # 8 rows over 4 data-parallel positions


def test_make_global_batch_rejects_rows_not_multiple_of_positions():
    mesh = sharding.make_mesh({"data": 8})
    with pytest.raises(ShardingError, match=r"batch\['x'\]"):
        sharding.make_global_batch({"x": np.zeros((1, 3))}, mesh)


def fake_mesh(process_of):
    """A duck-typed 2x2x2 mesh whose devices belong to processes ``process_of(d, f, t)``."""
    grid = np.empty((2, 2, 2), object)
    for index in np.ndindex(grid.shape):
        grid[index] = SimpleNamespace(process_index=process_of(*index))
    return SimpleNamespace(
        devices=grid,
        axis_names=("data", "fsdp", "tensor"),
        shape={"data": 2, "fsdp": 2, "tensor": 2},
    )


def test_local_dp_indices():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    np.testing.assert_array_equal(sharding.local_dp_indices(mesh), [0, 1, 2, 3])
    by_host = fake_mesh(lambda d, f, t: d)  # one host per data index
    np.testing.assert_array_equal(sharding.local_dp_indices(by_host, 0), [0, 1])
    np.testing.assert_array_equal(sharding.local_dp_indices(by_host, 1), [2, 3])
    by_fsdp = fake_mesh(lambda d, f, t: f)  # hosts interleaved: positions data*2 + fsdp
    np.testing.assert_array_equal(sharding.local_dp_indices(by_fsdp, 1), [1, 3])
