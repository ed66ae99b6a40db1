"""LoRA adapters (model.<tower>.lora, model.projector_lora): same math, a frozen base that gets
no gradient and no optimizer state, sharded like the matrices it adapts, under remat policies
and dropout; the cost model's price of a tower under adapters; checkpoints that hold the
adapters but not the base, and refuse another base by name. PEFT in and out: test_lora_hf.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from jaxmllm.config import ConfigError, load_config
from jaxmllm.cost.calibrate import _model_config
from jaxmllm.cost.model import CostModel
from jaxmllm.cost.training import modules
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.hf.load import nest
from jaxmllm.models.lora import LEAVES
from jaxmllm.pipeline.costs import model_costs
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.program import build_program, join, make_loss_and_grads
from sharding.rules import keyed_leaves

FIXED = [
    "data.synthetic.num_samples=256",
    "batch.capacity=fixed",
    "batch.vision_patches=640",
    "batch.audio_frames=256",
    "batch.route_pair_capacity=160",
    "data.eval.source=none",
]
LORA = [
    "model.llm.lora.rank=4",
    "model.vision.lora.rank=2",
    "model.vision.lora.targets=[q,v,up]",
    "model.projector_lora.rank=3",
    "model.projector_lora.targets=[fc2]",
]
NO_AUDIO = ["model.audio.enabled=false", "data.synthetic.audio_fraction=0"]  # (a compile less)


def setup(*overrides):
    """(config resolved on the data, its mesh, one step's host batch)."""
    run = resolve_run(load_config("configs/tiny.yaml", [*FIXED, *overrides]))
    host = next(make_pipeline(run, prefetch=0))["batch"]
    return run.cfg, run.mesh, host


def loss_and_grads(cfg, mesh, host, state=None, loss_only=False):
    """(program, its state, (loss, grads) of the host batch) on the config's mesh; with
    `loss_only`, the loss alone (the gradients left out of the program: its forward only)."""
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = prog.init() if state is None else jax.device_put(state, prog.shardings)
        batch = sharding.make_global_batch(host, mesh)
        step = make_loss_and_grads(prog.parts)
        fn = jax.jit((lambda *args: step(*args)[0]) if loss_only else step)
        got = jax.device_get(fn(state["params"], state["frozen"], batch))
    return prog, state, got


def test_config_names_the_valid_targets_and_refuses_what_cannot_train():
    with pytest.raises(
        ConfigError,
        match=r"model\.llm\.lora\.targets: 'fc1': gated_silu blocks "
        r"have no such matrix; valid: q, k, v, o, gate, up, down \(or all\)",
    ):
        load_config(
            "configs/tiny.yaml", ["model.llm.lora.rank=4", "model.llm.lora.targets=[q,fc1]"]
        )
    mlp = [
        "model.vision.mlp=quick_gelu",
        "model.vision.lora.rank=2",
        "model.vision.lora.targets=[up]",
    ]
    with pytest.raises(ConfigError, match=r"valid: q, k, v, o, fc1, fc2"):
        load_config("configs/tiny.yaml", mlp)
    with pytest.raises(ConfigError, match=r"model\.llm\.freeze: true freezes the whole tower"):
        load_config("configs/tiny.yaml", ["model.llm.lora.rank=4", "model.llm.freeze=true"])
    with pytest.raises(ConfigError, match=r"model\.llm\.base_dtype: 'bfloat16': the tower trains"):
        load_config("configs/tiny.yaml", ["model.llm.base_dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"projector_lora\.targets: 'gate': the projectors"):
        load_config(
            "configs/tiny.yaml",
            ["model.projector_lora.rank=2", "model.projector_lora.targets=[gate]"],
        )
    cfg = load_config("configs/tiny.yaml", LORA)
    assert cfg.model.llm.adapter_targets == ("q", "k", "v", "o", "gate", "up", "down")
    assert cfg.model.adapted("vision") == ("q", "v", "up")
    assert cfg.model.adapted("vision_projector") == ("fc2",) == cfg.model.adapted("audio_projector")


def test_fresh_adapters_change_nothing_and_only_they_get_gradients():
    """B = 0: the loss is the base model's (the same base, drawn from the same seed: the
    adapters' init does not move the base's random draws), and the gradients reach the
    adapters (B's: A's is zero while B is) and the projector the config leaves trainable,
    nothing of a base; only they have optimizer state."""
    adapters = ["model.llm.lora.rank=4", "model.vision.lora.rank=2"]
    cfg, mesh, host = setup(*NO_AUDIO, *adapters, "model.vision.lora.targets=[q,v,up]")
    prog, state, (loss, grads) = loss_and_grads(cfg, mesh, host)
    base_cfg = load_config("configs/tiny.yaml", [*FIXED, *NO_AUDIO])
    base_cfg = resolve_run(base_cfg, 8).cfg
    _, base_state, base_loss = loss_and_grads(base_cfg, mesh, host, loss_only=True)
    mine = keyed_leaves(jax.device_get(join(state["params"], state["frozen"])))
    theirs = keyed_leaves(jax.device_get(join(base_state["params"], base_state["frozen"])))
    assert set(mine) - set(theirs) == {p for p in mine if p.split("/")[-1] in LEAVES}
    for path, value in theirs.items():
        np.testing.assert_array_equal(mine[path], value, err_msg=path)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)

    assert set(prog.parts.adapted) == {"llm", "vision"} and not prog.parts.frozen_keys
    trained = keyed_leaves(grads)
    assert set(trained) == set(keyed_leaves(state["params"]))
    for path, g in trained.items():
        module, leaf = path.split("/")[0], path.split("/")[-1]
        if module == "vision_projector":  # (trained whole)
            assert np.abs(g).max() > 0, path
            continue
        assert leaf in LEAVES, path  # (a module with adapters trains only them)
        assert np.abs(g).max() > 0 if leaf == "lora_b" else not np.abs(g).any(), path
    assert {p.split("/")[0] for p in trained} == {"llm", "vision", "vision_projector"}
    opt = keyed_leaves(jax.device_get(state["opt_state"]))
    assert all(p.split("/")[-1] in (*LEAVES, "count") or "projector" in p for p in opt)


def test_adapters_are_sharded_like_the_matrices_they_adapt():
    """A carries the kernel's input axes, B its output axes, the rank none: under FSDP and
    tensor parallelism they split as their matrix does (in a scanned stack, `layers` first)."""
    cfg, mesh, _ = setup(*NO_AUDIO, *LORA, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
    blocks = prog.shardings["params"]["llm"]["transformer"]["blocks"]
    assert blocks["mlp"]["up"]["lora_a"].spec == jax.P(None, "fsdp", None)
    assert blocks["mlp"]["up"]["lora_b"].spec == jax.P(None, None, "tensor")
    assert blocks["attn"]["query"]["lora_b"].spec == jax.P(None, None, "tensor", None)
    assert blocks["attn"]["out"]["lora_a"].spec == jax.P(None, "tensor", None, None)
    projector = prog.shardings["params"]["vision_projector"]["fc2"]
    assert projector["lora_a"].spec == jax.P("tensor", None)
    assert prog.shardings["frozen"]["llm"]["transformer"]["blocks"]["mlp"]["up"]["kernel"].spec == (
        jax.P(None, "fsdp", "tensor")
    )


@pytest.mark.slow  # (two compiles of the multimodal step)
def test_adapters_under_fsdp_tensor_and_remat_give_the_unsplit_math():
    """Trained adapters (B non-zero), dropout on: the loss and gradients on data 2 x fsdp 2 x
    tensor 2 with full remat equal those on 4 data-parallel devices without remat (the same
    dropout masks: they fold the step, microbatch and layer, not the mesh). (Stages: the
    pipeline test below.)"""
    split = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.remat=full"]
    drop = ["model.llm.lora.dropout=0.2", "model.vision.lora.dropout=0.1"]
    cfg, mesh, host = setup(*NO_AUDIO, *LORA, *drop, *split)
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = jax.device_get(prog.init())
    rng = np.random.default_rng(0)
    trained = lambda p, x: (
        rng.normal(0, 0.05, x.shape).astype(x.dtype) if p.endswith("lora_b") else x
    )
    params = {p: trained(p, x) for p, x in keyed_leaves(state["params"]).items()}
    state = {**state, "params": nest(params)}

    def run(cfg, mesh):
        from jaxmllm.models import lora

        with jax.set_mesh(mesh):
            prog = build_program(cfg, mesh)
            placed = jax.device_put(state, prog.shardings)
            batch = sharding.make_global_batch(host, mesh)

            def fn(params, frozen, batch):
                with lora.dropout_key(jax.random.PRNGKey(7)):
                    return make_loss_and_grads(prog.parts)(params, frozen, batch)

            return jax.device_get(jax.jit(fn)(placed["params"], placed["frozen"], batch))

    got = run(cfg, mesh)
    one = ["mesh.data=4", "mesh.fsdp=1"]
    flat = load_config("configs/tiny.yaml", [*FIXED, *NO_AUDIO, *LORA, *drop, *one])
    flat = resolve_run(flat, 4).cfg  # (the same 4 data-parallel buckets)
    want = run(flat, sharding.make_mesh(flat.mesh, devices=jax.devices()[:4]))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    wanted = keyed_leaves(want[1])
    for path, g in keyed_leaves(got[1]).items():
        np.testing.assert_allclose(g, wanted[path], rtol=2e-4, atol=2e-6, err_msg=path)


def test_dropout_masks_differ_by_salt_and_repeat_under_the_same_key():
    """The adapters' dropout: none without a key; under one, each scope (a layer, a
    microbatch) and each matrix draws its own mask, the same ones again for the same key."""
    from jaxmllm.models import lora

    x = jnp.ones((4, 64))
    assert lora.dropped(x, 0.5) is x
    draw = lambda key, salt: lora.dropout_key(key)

    def masks(key):
        with lora.dropout_key(key):
            out = []
            for layer in range(2):
                with lora.salted(layer):
                    out += [lora.dropped(x, 0.5), lora.dropped(x, 0.5)]
            return out

    first, again = masks(jax.random.PRNGKey(0)), masks(jax.random.PRNGKey(0))
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len({np.asarray(m).tobytes() for m in first}) == 4  # (every scope, every matrix)
    assert set(np.unique(np.asarray(first[0]))) == {0.0, 2.0}  # (inverted: kept ones / 0.5)
    del draw


def test_a_tower_under_adapters_is_priced_as_passing_gradients(tmp_path):
    """Its base computes its activations' gradients (2x its forward), no weight gradients;
    its adapters add their own forward, 3x. Frozen everything else: the LLM alone would run
    forward only (1x) without them. The partitioner's stacks say the same per layer."""
    frozen = ["model.vision.freeze=true", "model.audio.freeze=true", "model.projector_freeze=true"]
    base = load_config("configs/tiny.yaml", [*frozen, "model.llm.freeze=false"])
    lora = load_config("configs/tiny.yaml", [*frozen, "model.llm.lora.rank=8"])
    full, adapted = CostModel.from_model(base.model), CostModel.from_model(lora.model)
    how = modules(lora.model)
    assert how["llm"].multiplier == 2 and how["vision"].multiplier == 1
    lm = lora.model.llm
    d, kv, f = lm.width, lm.head_width * lm.kv_heads, lm.mlp_dim
    per_layer = 2 * 8 * ((d + d) * 2 + (d + kv) * 2 + (d + f) * 3)  # q, o; k, v; gate, up, down
    want = full.phase("llm").linear * 2 / 3 + 3 * lm.depth * per_layer
    assert adapted.phase("llm").linear == pytest.approx(want)
    assert adapted.phase("llm").quadratic == pytest.approx(full.phase("llm").quadratic * 2 / 3)
    # (a run's config.json, as calibration reads it: a LoRA run's multiplier comes with it)
    (tmp_path / "config.json").write_text(json.dumps({"model": _asdict(lora.model)}))
    as_read = _model_config(tmp_path / "config.json")
    assert CostModel.from_model(as_read).to_dict() == adapted.to_dict()

    batch = resolve_run(lora, 8).cfg.batch
    costs, costs_full = model_costs(lora.model, batch), model_costs(base.model, batch)
    layer, layer_full = costs.segment("llm").layer, costs_full.segment("llm").layer
    tokens = batch.llm_rows * batch.llm_row_len
    assert layer.fwd == pytest.approx(layer_full.fwd + per_layer * tokens)
    assert layer.bwd == pytest.approx(layer_full.bwd / 2 + 2 * per_layer * tokens)
    assert costs.segment("vision").layer.bwd == 0  # (frozen, nothing below: forward only)


def _asdict(section):
    import dataclasses

    return dataclasses.asdict(section)


def test_base_dtype_stores_the_frozen_base_in_bf16_and_the_adapters_in_fp32():
    """(The checkpoint test below trains on a bf16 base.)"""
    sets = [
        "model.llm.lora.rank=4",
        "model.llm.base_dtype=bfloat16",
        "model.vision.freeze=true",
        "model.vision.base_dtype=bfloat16",
        "model.param_dtype=bfloat16",
    ]
    cfg, mesh, _ = setup(*sets)
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
    frozen, params = prog.abstract["frozen"], prog.abstract["params"]
    assert {x.dtype for x in jax.tree.leaves(frozen["llm"])} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(frozen["vision"])} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(params["llm"])} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(params["audio"])} == {jnp.dtype("bfloat16")}


@pytest.mark.slow  # (~35 s: two runs; test_lora_hf's LoRA runs read adapters back from a run too)
def test_checkpoints_hold_the_adapters_not_the_base_and_refuse_another_base(tmp_path):
    """A LoRA run's checkpoints hold its adapters and their optimizer state, none of the
    frozen base's bytes (read again from model.init_from, here the seed's random init), with
    the base's identity; a resume on another base (another seed) is refused naming both;
    generation reads the run back with the base it trained on (a bf16 base here)."""
    import orbax.checkpoint as ocp

    from jaxmllm import train
    from jaxmllm.generate import load_run

    sets = [
        *FIXED,
        "model.llm.base_dtype=bfloat16",
        "model.llm.lora.rank=4",
        "model.llm.lora.dropout=0.1",
        "train.steps=2",
        "model.vision.freeze=true",
        "model.audio.enabled=false",
        "train.checkpoint_every=2",
        "data.synthetic.audio_fraction=0",
        f"train.output_dir={tmp_path}",
    ]
    train.main(load_config("configs/tiny.yaml", sets))
    state = tmp_path / "checkpoints" / "2" / "state"
    saved = ocp.StandardCheckpointer().metadata(state).item_metadata
    assert set(saved) == {"params", "opt_state", "step"}
    shapes = keyed_leaves(saved["params"])
    assert all(
        p.split("/")[-1] in LEAVES or p.startswith(("vision_projector", "audio")) for p in shapes
    )
    stamp = json.loads((tmp_path / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert stamp["base"]["init_from"]["llm"] == "" and stamp["base"]["seed"] == 0

    cfg, params, step = load_run(tmp_path)
    assert step == 2
    fresh = load_config("configs/tiny.yaml", sets)
    fresh = resolve_run(fresh, 8).cfg
    from jaxmllm.step.program import base_dtypes, build_model

    start, base = jax.jit(lambda: build_model(fresh, 0))()
    base = base_dtypes(fresh, base)  # (bf16: model.llm.base_dtype)
    for path, value in keyed_leaves(jax.device_get(params["frozen"])).items():
        np.testing.assert_array_equal(value, keyed_leaves(jax.device_get(base))[path], path)
    moved = keyed_leaves(jax.device_get(params["params"]))
    assert any(
        not np.array_equal(v, keyed_leaves(jax.device_get(start))[p])
        for p, v in moved.items()
        if p.endswith("lora_b")
    )

    from jaxmllm import generate

    assert generate.main(["--run", str(tmp_path), "--max-new-tokens", "4", "--prompt", "1 2"]) == 0

    from jaxmllm.init_from import initial_params

    later = load_config("configs/tiny.yaml", [*sets, f"model.init_from.run={tmp_path}"])
    later = resolve_run(later, 8).cfg
    with pytest.raises(ConfigError, match=r"that run trained LoRA adapters on llm.*--merged"):
        initial_params(later, build_program(later, sharding.make_mesh(later.mesh)))

    with pytest.raises(
        ConfigError,
        match=r"trained on the base \(drawn from train.seed=0; "
        r"content hash [0-9a-f]+\), but the base read now is \(drawn from "
        r"train.seed=1",
    ):
        train.main(load_config("configs/tiny.yaml", [*sets, "train.seed=1", "train.steps=3"]))


@pytest.mark.slow  # (~60 s on a quiet 2-core box: three compiles, pipelined, not, a variant)
def test_adapters_in_pipeline_stages_give_the_unpipelined_math():
    """2 stages x 4 data-parallel buckets, the LLM's adapters split over the stages with its
    layers (their optimizer state too), the vision tower frozen and data-parallel across the
    stages: the loss and the adapters' gradients are the unpipelined step's, and again with
    the vision bucket cut (a step variant: test_pipeline's frozen data-parallel encoder case);
    the partitioner priced the LLM's stages with their activations' gradients and adapters."""
    from test_pipeline import (
        assert_a_cut_vision_bucket_changes_nothing,
        assert_same_math,
        pipelined_and_reference,
    )

    prog, state, got, want, (cfg, host, run) = pipelined_and_reference(
        "mesh.stage=2",
        "mesh.data=4",
        "mesh.fsdp=1",
        "model.llm.lora.rank=4",
        "model.vision.freeze=true",
        "pipeline.vision=data",
        "pipeline.audio=data",
        "model.audio.lora.rank=2",
    )
    assert_same_math(got, want)
    assert_a_cut_vision_bucket_changes_nothing(prog, cfg, host, run, want)
    assert set(prog.parts.adapted) == {"llm", "audio"}
    staged = keyed_leaves(state["params"]["llm"])
    assert all(p.split("/")[-1] in LEAVES for p in staged)
    assert all(v.shape[0] == 2 for p, v in staged.items() if "blocks" in p)  # [stage, ...]
    llm = [s for s in prog.plan.stages if s.segment == "llm"]
    assert llm and all(0 < s.work.bwd < 2 * s.work.fwd for s in llm)
    with jax.set_mesh(prog.mesh):  # (a checkpoint: [depth, ...], no base; back to stages)
        saved, base = prog.saved(state), prog.weights(state)["frozen"]
        assert set(saved) == {"params", "opt_state", "step"}
        back = jax.device_get(prog.restored(saved, base))
    for (path, a), b in zip(
        keyed_leaves(back).items(), jax.tree.leaves(jax.device_get(state)), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=path)
