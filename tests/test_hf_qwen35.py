"""Qwen3.5 and Qwen3.5-MoE text checkpoints in and out, held to transformers: tiny random
hybrids built in tmp_path (tests/hf_models.py), logits in fp32 on packed rows, the variants a
user meets (other layer patterns, head counts, key/value head ratios, conv widths, partial
rotary, tied embeddings, experts)."""

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
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.towers import config_for, load_towers
from sharding.rules import keyed_leaves

transformers = pytest.importorskip("transformers")

BUILD = {
    "qwen3_5": lambda d: hf_models.qwen3_5(d),
    "qwen3_5-moe": lambda d: hf_models.qwen3_5(d, experts=4),
    # full attention first and twice, linear layers between
    "full-first": lambda d: hf_models.qwen3_5(d, layers=("full", "linear", "full", "linear")),
    # 6 query heads a kv head; a key head serving 3 value heads; a 3-tap convolution
    "heads-6-1-ratio-3-conv-3": lambda d: hf_models.qwen3_5(
        d, heads=(6, 1), linear_heads=(1, 3), conv=3, layers=("linear", "full", "linear")
    ),
    # tied embeddings, a 2-tap convolution, rotary on half of each head
    "tied-conv-2-half-rotary": lambda d: hf_models.qwen3_5(d, tied=True, conv=2, partial=0.5),
    # experts with as many key as value heads, 16-wide keys
    "moe-ratio-1": lambda d: hf_models.qwen3_5(d, experts=6, linear_heads=(2, 2), key_dim=16),
}


@pytest.mark.parametrize("name", sorted(BUILD))
def test_our_hybrid_decoder_matches_transformers_on_packed_rows(name, tmp_path):
    """`hf check`: 150 tokens in three samples packed into one row (documents across the
    64-token chunks), each sample's logits within 1e-3 of transformers run on it alone."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=150)
    assert "3 samples packed into 1 row" in result["what"], result
    assert result["max_abs_ref"] > 5, result
    assert result["max_abs_diff"] < 1e-3, result


def test_the_packed_check_fails_when_the_state_is_not_restarted(tmp_path, monkeypatch):
    """The packed check holds the restarts: with the linear layers' documents not restarted
    (every row one document) the packed samples' logits are far from transformers'."""
    from jaxmllm.models import deltanet

    source = hf_models.qwen3_5(tmp_path / "m", vocab=296)  # (a program of its own)
    whole = deltanet.document_starts
    monkeypatch.setattr(
        deltanet, "document_starts", lambda seg, row=0: whole(jax.numpy.ones_like(seg), row)
    )
    jax.clear_caches()
    try:
        result = check_dir(source, tokens=150)
    finally:
        jax.clear_caches()
    assert result["max_abs_diff"] > 0.1, result


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5-moe"])
def test_import_then_export_is_bit_identical(name, tmp_path):
    """Every tensor consumed (the linear layers' fused in_proj_qkv and conv1d regrouped by
    key head, q_proj's queries and gates, the experts stacked) and written back bit for bit,
    with config.json's layer_types and linear-attention sizes."""
    source = BUILD[name](tmp_path / "source")
    cfg = config_for("llm", source)
    assert cfg.model.llm.linear.layers == (0, 1, 2)
    towers = load_towers(cfg, "llm")
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    assert flat["llm/transformer/blocks/attn/qkv/kernel"].shape == (3, 64, 2, 2 * 32 + 2 * 12)
    assert flat["llm/transformer/blocks/attn/conv"].shape == (3, 4, 2, 2 * 32 + 2 * 12)
    full = "full_moe_blocks" if "moe" in name else "full_blocks"
    assert flat[f"llm/transformer/{full}/attn/query/kernel"].shape == (1, 64, 4, 32)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    before, after = Checkpoint(source), Checkpoint(tmp_path / "out")
    assert set(after.names()) == set(before.names())
    for n in after.names():
        assert np.array_equal(before.get(n).view(np.uint8), after.get(n).view(np.uint8)), n
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    keys = ["layer_types", "linear_num_key_heads", "linear_num_value_heads"]
    keys += ["linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"]
    keys += ["num_experts", "shared_expert_intermediate_size"] if "moe" in name else []
    for key in keys:
        assert ours[key] == theirs[key], key
    assert ours["rope_parameters"]["partial_rotary_factor"] == 0.25
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))


def test_a_hybrid_given_as_model_is_a_text_only_model(tmp_path):
    """`hf import --model` on a Qwen3.5-MoE checkpoint writes a whole text-only config: the
    linear layers and their sizes, the gate, partial rotary, zero-centred norms, experts in
    every layer with the shared one; the trainer loads it."""
    from jaxmllm.config import load_config
    from jaxmllm.hf.__main__ import main

    source = hf_models.qwen3_5(tmp_path / "m", experts=4, layers=("linear", "full"))
    out = tmp_path / "run.yaml"
    assert main(["import", "--model", source, "--out", str(out)]) == 0
    llm = load_config(out).model.llm
    assert llm.linear.layers == (0,) and llm.linear.key_heads == 2 and llm.linear.conv_width == 4
    assert llm.attn_gate and llm.qk_norm and llm.norm == "rms_offset"
    assert llm.rotary_fraction == 0.25 and llm.rotary_dim == 4
    assert (llm.moe.experts, llm.moe.shared_mlp_dim, llm.moe.norm_topk_prob) == (4, 48, True)


def test_what_a_hybrid_does_not_run_with_is_refused_naming_the_key(tmp_path):
    """An unknown layer type names layer_types; context parallelism and pipeline stages over
    linear-attention layers are refused at start-up naming mesh.context and mesh.stage."""
    from jaxmllm.config import Config, ConfigError, from_dict
    from jaxmllm.hf.family import FamilyError

    source = Path(hf_models.qwen3_5(tmp_path / "m"))
    hf = json.loads((source / "config.json").read_text())
    hf["layer_types"][1] = "sliding_attention"
    (source / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FamilyError, match="layer_types.*sliding_attention"):
        write_config(tmp_path / "run.yaml", model=str(source))
    llm = {"linear": {"every": 4, "key_heads": 2, "value_heads": 4}, "depth": 4}
    with pytest.raises(ConfigError, match="mesh.context"):
        from_dict(Config, {"model": {"llm": llm}, "mesh": {"context": 2}})
    with pytest.raises(ConfigError, match="mesh.stage"):
        from_dict(Config, {"model": {"llm": llm}, "mesh": {"stage": 2}})
