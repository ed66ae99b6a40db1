"""Gemma 4's text decoder in and out, held to transformers: tiny random `Gemma4ForCausalLM`s built
in tmp_path (tests/hf_models.py), the full layers of their own head width and kv heads, their
rotary proportional, values normed, layer scalars drawn, logits soft-capped, windows shorter
than the check's texts, per-layer inputs, the last layers reusing earlier layers' keys and
values (their MLPs maybe twice as wide), logits in fp32 on packed rows; negative controls that
show the check holds the proportional rotary and the shared keys; export bit for bit; the MoE
block (Gemma-4-26B-A4B's) held the same, its router's input by a negative control, its experts
over the mesh giving one device's logits; what a Gemma 4 config.json may set and jaxmllm does
not run, refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import jax
import numpy as np
import pytest
from flax import nnx

from jaxmllm.hf.check import check_dir
from jaxmllm.hf.export import export_role
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.towers import config_for, load_towers
from jaxmllm.models import layers, moe
from jaxmllm.models.attention import Attention
from jaxmllm.models.transformer import Block, Transformer
from sharding.rules import keyed_leaves

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # (every test here runs transformers' models, on torch)

BUILD = {
    # 3 sliding layers of a 5-token window, 2 full ones (head width 32, the sliding 24), tied
    "gemma4": lambda d: hf_models.gemma4_text(d),
    # untied, biases, the full layers' values their keys' (one kv head), full attention first
    "untied-k-eq-v-bias": lambda d: hf_models.gemma4_text(
        d,
        layers=("full", "sliding", "sliding", "full"),
        window=9,
        tied=False,
        k_eq_v=True,
        bias=True,
    ),
    # the MoE block in every layer: 8 experts, top-2, beside each layer's MLP
    "moe": lambda d: hf_models.gemma4_text(d, experts=8),
    # per-layer inputs (8 wide, a table of its own vocabulary); the last sliding and full
    # layers (3, 4) reuse the keys of layers 1 and 2, their MLPs twice as wide
    "ple-shared-wide": lambda d: hf_models.gemma4_text(d, per_layer=8, shared=2, wide=True),
    # a mixed pattern, the last three layers shared (full 4 and 6 read 1's keys, sliding 5
    # reads 3's), the full layers' values their keys', untied, per-layer inputs (transformers
    # 5.24 runs shared layers only with them: without, its forward slices None)
    "shared-mixed-k-eq-v": lambda d: hf_models.gemma4_text(
        d,
        layers=("sliding", "full", "sliding", "sliding", "full", "sliding", "full"),
        window=7,
        shared=3,
        per_layer=8,
        k_eq_v=True,
        tied=False,
    ),
    # no windows: every layer full, the last two reuse layer 1's keys; per-layer inputs
    "full-shared-ple": lambda d: hf_models.gemma4_text(
        d, layers=("full",) * 4, per_layer=16, shared=2
    ),
}


# (run with the slow tests: two more layouts of what ple-shared-wide holds fast)
SLOW_BUILDS = {"shared-mixed-k-eq-v", "full-shared-ple"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_BUILDS else n for n in sorted(BUILD)],
)
def test_our_gemma4_matches_transformers_on_packed_rows(name, tmp_path):
    """`hf check`: three texts (64, 40 and 16 tokens) packed into one row, each longer than
    the window, each text's logits within 1e-3 of transformers run on it alone."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=64)
    assert "3 texts" in result["what"] and "packed into 1 row" in result["what"], result
    assert result["max_abs_ref"] > 1, result
    assert result["max_abs_diff"] < 1e-3, result


def test_the_check_fails_when_the_full_layers_turn_every_frequency(tmp_path, monkeypatch):
    """transformers' proportional rotary turns the first quarter of the full layers'
    frequencies and leaves the rest still: the same layers with every frequency turning (the
    scaling read as none) are far from transformers'."""
    source = hf_models.gemma4_text(tmp_path / "m", vocab=297)
    whole = layers.rope_frequencies

    def every_frequency(dim, theta, scaling=None):
        plain = None if getattr(scaling, "type", "") == "proportional" else scaling
        return whole(dim, theta, plain)

    monkeypatch.setattr(layers, "rope_frequencies", every_frequency)
    jax.clear_caches()
    try:
        result = check_dir(source, tokens=64)
    finally:
        jax.clear_caches()
    assert result["max_abs_diff"] > 1e-2, result


def test_the_check_fails_when_the_router_reads_the_experts_normed_input(tmp_path, monkeypatch):
    """transformers' Gemma 4 router reads the residual stream (its own norm and scale), not
    the experts' input, normed by pre_feedforward_layernorm_2: the same layers routing that
    input are far from transformers'."""
    source = BUILD["moe"](tmp_path / "m")
    own = moe.MoE.router_input
    monkeypatch.setattr(moe.MoE, "router_input", lambda self, x, residual: own(self, x, None))
    jax.clear_caches()
    try:
        result = check_dir(source, tokens=64)
    finally:
        jax.clear_caches()
    assert result["max_abs_diff"] > 1e-2, result


def test_the_check_fails_when_a_shared_layer_computes_its_own_keys(tmp_path, monkeypatch):
    """The layers sharing keys attend over their source layer's keys and values, computed from
    that layer's input: the same layers each computing keys and values of its own input (with
    its source layer's projections) are far from transformers'."""
    source = BUILD["ple-shared-wide"](tmp_path / "m")
    call = Attention.__call__

    def sources(self, inputs, positions):  # (the source layers themselves, not their keys)
        return {kind: self.layer(i) for kind, i in self.kv_sources.items()}

    def own_keys(self, x_btd, pack, positions, kv=None):
        if isinstance(kv, Block):  # (this layer's input through the source's projections)
            kv = kv.attn.keys_values(x_btd, positions)
        return call(self, x_btd, pack, positions, kv)

    monkeypatch.setattr(Transformer, "shared_kv", sources)
    monkeypatch.setattr(Attention, "__call__", own_keys)
    jax.clear_caches()
    try:
        result = check_dir(source, tokens=64)
    finally:
        jax.clear_caches()
    assert result["max_abs_diff"] > 1e-2, result


@pytest.mark.slow  # (the layer over the mesh, gradients too, is test_moe's fast Gemma case)
def test_experts_over_the_mesh_give_one_device_s_logits(tmp_path):
    """The MoE Gemma 4's experts split over mesh.expert=4 (8 devices: data 2 x expert 4, each
    device's tokens sent by all-to-all to their experts' devices and back): logits of packed
    rows (two documents each) equal one device's, and the program does exchange them."""
    import sharding

    source = BUILD["moe"](tmp_path / "m")
    graphdef, state = nnx.split(load_towers(config_for("llm", source), "llm"))

    def logits(state, ids, seg, pos):
        llm = nnx.merge(graphdef, state).llm
        return llm(llm.embed(ids), seg, pos)

    rng = np.random.default_rng(0)
    lengths = (20, 12)
    ids = rng.integers(0, 300, (8, sum(lengths)))
    seg = np.tile(np.repeat([1, 2], lengths), (8, 1))
    pos = np.tile(np.concatenate([np.arange(n) for n in lengths]), (8, 1))
    one = np.asarray(jax.jit(logits)(state, ids, seg, pos))
    mesh = sharding.make_mesh({"data": -1, "expert": 4})
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with jax.set_mesh(mesh):
        lowered = jax.jit(logits).lower(state, ids, seg, pos)
        spread = np.asarray(lowered.compile()(state, ids, seg, pos))
    assert "all_to_all" in lowered.as_text()
    scale = np.abs(one).max()
    assert scale > 1
    # (each device's experts see other groups of tokens than one device's, so the matmuls
    # round apart in float32: 1.2e-5 measured on logits up to 10.8 on an AVX-512 Xeon, 1e-6 of
    # them; a token sent to the wrong expert or not back is off by the logits' own size)
    np.testing.assert_allclose(spread, one, atol=4e-6 * scale)


@pytest.mark.parametrize("experts", [0, 6], ids=["dense", "moe"])
def test_import_then_export_is_bit_identical(experts, tmp_path):
    """Every tensor consumed (no value projection in the full layers with attention_k_eq_v,
    each layer's layer_scalar; the MoE block's router, fused experts and norms), the sliding
    and full layers stacked apart at their own head shapes, and written back bit for bit with
    config.json's per_layer_config, rotary, soft cap and MoE keys; transformers loads the
    export and the check holds."""
    source = hf_models.gemma4_text(
        tmp_path / "source",
        layers=("full", "sliding", "sliding", "full"),
        window=9,
        tied=False,
        k_eq_v=True,
        bias=True,
        experts=experts,
        top_k=3,
    )
    cfg = config_for("llm", source)
    llm = cfg.model.llm
    assert llm.window.layers == (1, 2) and llm.window.size == 9
    assert (llm.norm, llm.head_width, llm.kv_heads) == ("rms", 24, 2)
    assert (llm.full_head_dim, llm.full_kv_heads, llm.full_k_eq_v) == (32, 1, True)
    assert llm.v_norm and llm.layer_scalar and llm.logit_softcap == 30.0
    assert llm.rope_scaling.type == "proportional" and llm.rope_scaling.fraction == 0.25
    towers = load_towers(cfg, "llm")
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    # (two layers of each kind: the first's, a full one, is the main stack, `blocks`)
    full, sliding = "blocks", "sliding_moe_blocks" if experts else "sliding_blocks"
    stack = lambda s, path: flat[f"llm/transformer/{s}/{path}"]  # noqa: E731
    assert stack(full, "attn/key/kernel").shape == (2, 64, 1, 32)
    assert f"llm/transformer/{full}/attn/value/kernel" not in flat
    assert stack(sliding, "attn/value/kernel").shape == (2, 64, 2, 24)
    assert stack(full, "layer_scalar").shape == (2, 1)
    if experts:  # (the dense MLP the shared expert, the experts stacked from gate_up_proj)
        assert (llm.moe.experts, llm.moe.top_k, llm.moe.shared_mlp_dim) == (6, 3, 96)
        assert stack(full, "mlp/shared/gate/kernel").shape == (2, 64, 96)
        assert stack(full, "mlp/experts/gate").shape == (2, 6, 64, 32)
        assert stack(sliding, "mlp/experts/down").shape == (2, 6, 32, 64)
        assert stack(full, "mlp/expert_scale").shape == (2, 6)
        assert stack(full, "experts_post_norm/scale").shape == (2, 64)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    hf_models.assert_bit_identical(source, tmp_path / "out")
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    keys = ("layer_types", "sliding_window", "rope_parameters", "per_layer_config")
    moe_keys = ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")
    for key in (*keys, "attention_k_eq_v", "final_logit_softcapping", *moe_keys):
        assert ours[key] == theirs[key], key
    assert ours["architectures"] == ["Gemma4ForCausalLM"]
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))
    result = check_dir(str(tmp_path / "out"), tokens=32)  # (transformers loads the export)
    assert result["max_abs_diff"] < 1e-3, result


def test_per_layer_inputs_and_shared_keys_import_then_export_bit_identical(tmp_path):
    """Per-layer inputs (their table, projection and norm; each layer's gate, projection and
    norm) and the last two layers reusing keys (a stack each, sliding and full, without key
    and value projections, their MLPs twice as wide) consumed whole and written back bit for
    bit with config.json's keys of them; transformers loads the export and the check holds.
    A config.json without hidden_size_per_layer_input reads transformers' 256."""
    source = BUILD["ple-shared-wide"](tmp_path / "source")
    cfg = config_for("llm", source)
    llm = cfg.model.llm
    assert (llm.per_layer_dim, llm.per_layer_vocab, llm.per_layer_pad_id) == (8, 320, 3)
    assert (llm.kv_shared_layers, llm.kv_shared_wide_mlp) == (2, True)
    assert llm.kv_source(3) == 1 and llm.kv_source(4) == 2
    towers = load_towers(cfg, "llm")
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    assert flat["llm/per_layer/embed/embedding"].shape == (320, 5 * 8)
    assert flat["llm/per_layer/projection/kernel"].shape == (64, 5, 8)
    assert flat["llm/transformer/blocks/per_layer_gate/kernel"].shape == (2, 64, 8)
    for stack in ("sliding_shared_blocks", "full_shared_blocks"):
        assert f"llm/transformer/{stack}/attn/key/kernel" not in flat
        assert flat[f"llm/transformer/{stack}/mlp/up/kernel"].shape == (1, 64, 2 * 96)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    hf_models.assert_bit_identical(source, tmp_path / "out")
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    keys = ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "pad_token_id")
    for key in (*keys, "num_kv_shared_layers", "use_double_wide_mlp", "layer_types"):
        assert ours[key] == theirs[key], key
    result = check_dir(str(tmp_path / "out"), tokens=32)  # (transformers loads the export)
    assert result["max_abs_diff"] < 1e-3, result
    del theirs["hidden_size_per_layer_input"]
    (Path(source) / "config.json").write_text(json.dumps(theirs))
    assert config_for("llm", source).model.llm.per_layer_dim == 256


@pytest.mark.parametrize(
    "key, value",
    [
        ("top_k_experts", 9),
        ("use_bidirectional_attention", "all"),
        ("num_kv_shared_layers", 5),  # (every layer: none would compute keys)
        ("num_kv_shared_layers", 3),  # (the full layers 2 and 4 shared: none before them)
    ],
)
def test_what_gemma4_sets_and_jaxmllm_does_not_run_is_refused(key, value, tmp_path):
    """More experts a token than the MoE block has, bidirectional text, and keys shared by
    every layer or by a layer with no earlier one of its type are refused, the error naming
    config.json's key."""
    source = Path(hf_models.gemma4_text(tmp_path / "m", experts=4 if "expert" in key else 0))
    hf = json.loads((source / "config.json").read_text())
    hf[key] = value
    (source / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FamilyError, match=key):
        config_for("llm", str(source))
