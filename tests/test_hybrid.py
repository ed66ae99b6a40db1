"""A hybrid decoder (configs/tiny_hybrid.yaml: Gated DeltaNet layers among full-attention ones)
as the planner and the step see it: its cost model counts the full-attention layers alone as
quadratic, and a linear layer's as what the step computes; LoRA's targets on both kinds."""

from __future__ import annotations

import math

import pytest

from jaxmllm.config import load_config


def test_only_the_full_attention_layers_are_quadratic_in_the_cost_model():
    """The LLM's quadratic coefficient counts its one full-attention layer of four (a
    full-attention twin: all four); its linear coefficient is 2 x its matmul weights (the
    full layer's q projection twice as wide for the gate) plus the linear layers'
    convolution and delta rule, x3 to train."""
    from jaxmllm.cost.flops import linear_attention
    from jaxmllm.cost.model import CostModel
    from jaxmllm.hf.adapter_load import shapes_of

    cfg = load_config("configs/tiny_hybrid.yaml")
    twin = load_config("configs/tiny_hybrid.yaml", ["model.llm.linear.every=0"])
    llm = cfg.model.llm
    hybrid, full = (CostModel.from_model(c.model).phase("llm") for c in (cfg, twin))
    q = llm.heads * llm.head_width
    assert hybrid.quadratic == pytest.approx(3 * 1 * 2.0 * q)
    assert full.quadratic == pytest.approx(4 * hybrid.quadratic)
    shapes = shapes_of(cfg)
    matmul = sum(
        math.prod(leaf.shape)
        for path, leaf in shapes.items()
        if path.startswith("llm/") and path.endswith("/kernel")
    )
    s = llm.linear
    channels = 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim
    own = linear_attention(llm) - 2.0 * matmul_of_linear_layer(llm)
    assert own == pytest.approx(
        2.0 * s.conv_width * channels
        + 4.0 * s.chunk * s.key_dim * s.key_heads
        + 2.0 * s.value_heads * (s.chunk**2 / 3 + s.chunk * (2 * s.value_dim + s.key_dim))
        + 2.0 * s.value_heads * 3 * s.key_dim * s.value_dim
    )
    assert hybrid.linear == pytest.approx(3 * (2 * matmul + len(llm.linear_layers) * own))


def matmul_of_linear_layer(llm) -> float:
    """A Gated DeltaNet layer's projection weights (qkv, z, b, a, out)."""
    s, d = llm.linear, llm.width
    channels = 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim
    return (
        d * channels
        + d * s.value_heads * s.value_dim
        + 2 * d * s.value_heads
        + (s.value_heads * s.value_dim * d)
    )


def test_lora_targets_the_linear_layers_matrices_too():
    """`all` adapts the full-attention layers' q, k, v, o, the linear layers' in_qkv, in_z,
    in_b, in_a, out_proj, and every MLP; the adapters sit where each kind has them."""
    from jaxmllm.models.mllm import kernel_paths

    cfg = load_config("configs/tiny_hybrid.yaml", ["model.llm.lora.rank=4"])
    paths = kernel_paths(cfg.model)
    mine = {p: t for p, (m, t) in paths.items() if m == "llm"}
    assert mine["llm/transformer/blocks/attn/qkv/kernel"] == "in_qkv"
    assert mine["llm/transformer/blocks/attn/out/kernel"] == "out_proj"
    assert mine["llm/transformer/full_blocks/attn/out/kernel"] == "o"
    assert mine["llm/transformer/full_blocks/mlp/gate/kernel"] == "gate"
    assert "llm/transformer/blocks/attn/query/kernel" not in mine
    assert "llm/transformer/full_blocks/attn/qkv/kernel" not in mine


@pytest.mark.slow  # (two compiles of the step)
def test_a_hybrid_split_over_fsdp_and_tensor_with_remat_gives_the_unsplit_math():
    """configs/tiny_hybrid.yaml (text: the planner's packed rows, documents restarting in the
    linear layers; block-sparse rows laid end to end, 2 microbatches): the loss and every
    gradient on data 2 x fsdp 2 x tensor 2 with full remat (the linear layers' key heads split
    over tensor) equal those on 4 data-parallel devices without remat."""
    import jax
    import numpy as np

    import sharding
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run
    from jaxmllm.step.program import build_program, make_loss_and_grads
    from sharding.rules import keyed_leaves

    text = ["model.vision.enabled=false", "model.audio.enabled=false"]
    text += ["data.synthetic.image_fraction=0", "data.synthetic.audio_fraction=0"]
    text += ["data.synthetic.multi_image_fraction=0", "data.synthetic.video_fraction=0"]
    text += ["data.synthetic.num_samples=256", "batch.capacity=fixed", "data.eval.source=none"]

    def run(overrides, devices, state=None):
        cfg = load_config("configs/tiny_hybrid.yaml", [*text, *overrides])
        run = resolve_run(cfg, jax.devices()[:devices])
        assert sharding.data_parallel_size(run.mesh) == 4  # (the same plans at every layout)
        host = next(make_pipeline(run, prefetch=0))["batch"]
        mesh = run.mesh
        with jax.set_mesh(mesh):
            prog = build_program(run.cfg, mesh)
            state = prog.init() if state is None else jax.device_put(state, prog.shardings)
            batch = sharding.make_global_batch(host, mesh)
            fn = jax.jit(make_loss_and_grads(prog.parts))
            return jax.device_get(state), jax.device_get(
                fn(state["params"], state["frozen"], batch)
            )

    split = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.remat=full"]
    state, got = run(split, 8)
    _, want = run(["mesh.data=4", "mesh.fsdp=1"], 4, state)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    wanted = keyed_leaves(want[1])
    for path, g in keyed_leaves(got[1]).items():
        np.testing.assert_allclose(g, wanted[path], rtol=2e-4, atol=2e-6, err_msg=path)
