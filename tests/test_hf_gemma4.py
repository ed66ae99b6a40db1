"""Gemma 4's text decoder in and out, held to transformers: tiny random `Gemma4ForCausalLM`s
built in tmp_path (tests/hf_models.py), the full layers of their own head width and kv heads,
their rotary proportional, values normed, layer scalars drawn, logits soft-capped, windows
shorter than the check's texts, logits in fp32 on packed rows; a negative control that shows
the check holds the proportional rotary; export bit for bit; what a Gemma 4 config.json may set
and jaxmllm does not run, refused naming the key."""

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
from jaxmllm.models import layers
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
}


@pytest.mark.parametrize("name", sorted(BUILD))
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


def test_import_then_export_is_bit_identical(tmp_path):
    """Every tensor consumed (no value projection in the full layers with attention_k_eq_v,
    each layer's layer_scalar), the sliding and full layers stacked apart at their own head
    shapes, and written back bit for bit with config.json's per_layer_config, rotary and soft
    cap; transformers loads the export and the check holds."""
    source = BUILD["untied-k-eq-v-bias"](tmp_path / "source")
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
    assert flat["llm/transformer/blocks/attn/key/kernel"].shape == (2, 64, 1, 32)
    assert "llm/transformer/blocks/attn/value/kernel" not in flat
    assert flat["llm/transformer/sliding_blocks/attn/value/kernel"].shape == (2, 64, 2, 24)
    assert flat["llm/transformer/blocks/layer_scalar"].shape == (2, 1)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    hf_models.assert_bit_identical(source, tmp_path / "out")
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    keys = ("layer_types", "sliding_window", "rope_parameters", "per_layer_config")
    for key in (*keys, "attention_k_eq_v", "final_logit_softcapping"):
        assert ours[key] == theirs[key], key
    assert ours["architectures"] == ["Gemma4ForCausalLM"]
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))
    result = check_dir(str(tmp_path / "out"), tokens=32)  # (transformers loads the export)
    assert result["max_abs_diff"] < 1e-3, result


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size_per_layer_input", 8),
        ("num_kv_shared_layers", 2),
        ("enable_moe_block", True),
        ("use_bidirectional_attention", "all"),
    ],
)
def test_what_gemma4_sets_and_jaxmllm_does_not_run_is_refused(key, value, tmp_path):
    """Per-layer inputs, shared keys and values, the MoE block and bidirectional text are
    refused, the error naming config.json's key."""
    source = Path(hf_models.gemma4_text(tmp_path / "m"))
    hf = json.loads((source / "config.json").read_text())
    hf[key] = value
    (source / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FamilyError, match=key):
        config_for("llm", str(source))
