"""Gemma 3's text decoder in and out, held to transformers: tiny random `Gemma3ForCausalLM`s
built in tmp_path (tests/hf_models.py), with sliding-window layers whose window is shorter than
the check's texts, logits in fp32 on packed rows; the negative controls that show the packed
check holds the window to its document and to transformers' size; export bit for bit; what a
Gemma 3 config.json may set and jaxmllm does not run, refused naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import hf_models
import jax
import numpy as np
import pytest
from flax import nnx

from jaxmllm.hf.check import check_dir
from jaxmllm.hf.export import export_role
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.towers import config_for, load_towers
from jaxmllm.models import attention
from sharding.rules import keyed_leaves

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # (every test here runs transformers' models, on torch)

BUILD = {
    # 4 sliding layers of a 5-token window and a full one, tied, 2 query heads a kv head
    "gemma3": lambda d: hf_models.gemma3_text(d),
    # untied, the full layers' rotary scaled linearly (4B and up), 4 query heads a kv head,
    # biases on q, k, v and o, a window of 9, full attention first
    "untied-linear-rope-bias": lambda d: hf_models.gemma3_text(
        d,
        layers=("full", "sliding", "sliding", "full"),
        window=9,
        tied=False,
        heads=(4, 1),
        scaling=8.0,
        bias=True,
        scalar=24,
    ),
}


@pytest.mark.parametrize("name", sorted(BUILD))
def test_our_gemma3_matches_transformers_on_packed_rows(name, tmp_path):
    """`hf check`: three texts (64, 40 and 16 tokens) packed into one row, each longer than
    the window, each text's logits within 1e-3 of transformers run on it alone."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=64)
    assert "3 texts" in result["what"] and "packed into 1 row" in result["what"], result
    assert result["max_abs_ref"] > 1, result
    assert result["max_abs_diff"] < 1e-3, result


def _check_with_window(source: str, monkeypatch, window_mask) -> dict:
    """`hf check` of `source` with the dense path's window mask replaced by `window_mask`."""
    monkeypatch.setattr(attention, "windowed", window_mask)
    jax.clear_caches()
    try:
        return check_dir(source, tokens=64)
    finally:
        jax.clear_caches()


def test_the_packed_check_fails_when_a_window_crosses_a_document(tmp_path, monkeypatch):
    """The packed check holds the window to its document: with the sliding layers' mask a
    band over the row (the segment ids left out), a text's first tokens see the end of the
    text before it, and the packed logits are far from transformers' (the full layers still
    keep to their documents)."""
    source = hf_models.gemma3_text(tmp_path / "m", vocab=296)

    def band_over_the_row(mask, window):
        """The window alone: causal, over any document."""
        t = mask.shape[-1]
        d = jax.numpy.arange(t)[:, None] - jax.numpy.arange(t)[None, :]
        return jax.numpy.broadcast_to((d >= 0) & (d < window), mask.shape)

    result = _check_with_window(source, monkeypatch, band_over_the_row)
    assert result["max_abs_diff"] > 0.1, result


@pytest.mark.parametrize("off", [1, -1])
def test_the_check_fails_when_the_window_is_one_token_off(off, tmp_path, monkeypatch):
    """transformers' window holds the query and the window - 1 tokens before it (key index >
    query index - sliding_window): a window one token wider or narrower fails the check."""
    source = hf_models.gemma3_text(tmp_path / "m", vocab=292 + off)
    whole = attention.windowed
    result = _check_with_window(source, monkeypatch, lambda mask, w: whole(mask, w + off))
    assert result["max_abs_diff"] > 1e-2, result


def test_import_then_export_is_bit_identical(tmp_path):
    """Every tensor consumed (the four norms a layer: transformers' post_attention_layernorm
    is the norm after attention, pre_feedforward_layernorm the one before the MLP), the sliding
    and full layers stacked apart, and written back bit for bit with config.json's layer
    types, window, rotary bases per layer type and query_pre_attn_scalar."""
    source = BUILD["untied-linear-rope-bias"](tmp_path / "source")
    cfg = config_for("llm", source)
    llm = cfg.model.llm
    assert llm.window.layers == (1, 2) and llm.window.size == 9
    assert (llm.norm, llm.mlp) == ("rms_offset", "gated_gelu_tanh")
    assert llm.post_norms and llm.embed_scale and llm.qk_norm and not llm.tie_embeddings
    assert llm.attn_scalar == 24 and llm.rope_scaling.type == "linear"
    towers = load_towers(cfg, "llm")
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    assert flat["llm/transformer/sliding_blocks/attn_post_norm/scale"].shape == (2, 64)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    hf_models.assert_bit_identical(source, tmp_path / "out")
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert ours[key] == theirs[key], key
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))
    result = check_dir(str(tmp_path / "out"), tokens=32)  # (transformers loads the export)
    assert result["max_abs_diff"] < 1e-3, result


def test_a_gemma3_given_as_model_is_a_config_the_trainer_loads(tmp_path):
    """`hf import --model` writes a text-only config with Gemma's options and its windows."""
    from jaxmllm.config import load_config
    from jaxmllm.hf.__main__ import main

    source = hf_models.gemma3_text(tmp_path / "m")
    out = tmp_path / "run.yaml"
    assert main(["import", "--model", source, "--out", str(out)]) == 0
    llm = load_config(out).model.llm
    assert llm.window.layers == (0, 1, 3, 4) and llm.window.rope_theta == 1e4
    kinds = [llm.layer_kind(i).name for i in range(5)]
    assert kinds == ["sliding", "sliding", "full", "sliding", "sliding"]
    assert llm.qk_norm and llm.tie_embeddings and not llm.tied_logits_scaled


REFUSED = {
    "final_logit_softcapping": (30.0, "final_logit_softcapping"),
    "attn_logit_softcapping": (50.0, "attn_logit_softcapping"),
    "use_bidirectional_attention": (True, "use_bidirectional_attention"),
    "hidden_activation": ("silu", "hidden_activation 'silu'"),
    "sliding_window": (None, "sliding_window None"),
    "layer_types": (["sliding_attention", "chunked_attention"] + ["full_attention"] * 3, "chunked"),
    "rope_parameters": (
        {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        },
        "sliding_attention.rope_type 'linear'",
    ),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_what_gemma3_sets_and_jaxmllm_does_not_run_is_refused_naming_the_key(key, tmp_path):
    """Logit soft-capping (final and attention), bidirectional attention, another activation,
    sliding layers without a window, a layer kind other than sliding or full, a scaled local
    rotary: each refused naming its config.json key."""
    source = Path(hf_models.gemma3_text(tmp_path / "m"))
    hf = json.loads((source / "config.json").read_text())
    value, words = REFUSED[key]
    hf[key] = value
    (source / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FamilyError, match=re.escape(words)):
        write_config(tmp_path / "run.yaml", model=str(source))


def test_older_config_files_name_the_bases_and_the_pattern_apart(tmp_path):
    """A config.json in the hub's older form (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern instead of layer_types) reads as transformers 5 reads it."""
    source = Path(hf_models.gemma3_text(tmp_path / "m", layers=("sliding",) * 5 + ("full",)))
    hf = json.loads((source / "config.json").read_text())
    del hf["rope_parameters"], hf["layer_types"]
    hf.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    (source / "config.json").write_text(json.dumps(hf))
    llm = config_for("llm", str(source)).model.llm
    assert llm.window.layers == (0, 1, 2, 3, 4) and llm.layer_kind(5).name == "full"
    assert (llm.rope_theta, llm.window.rope_theta) == (1e6, 1e4)
    assert (llm.rope_scaling.type, llm.rope_scaling.factor) == ("linear", 8.0)
