"""Gemma 4's audio encoder (the conformer, `model.audio.stem: conformer`) held to transformers'
Gemma4AudioModel; its import, export and packed-row parity with the clipped linears and a
right context are tests/test_hf.py's (`gemma4-audio`)."""

from __future__ import annotations

import json

import hf_models
import pytest

from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.hf.check import check_dir
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import data_section
from jaxmllm.hf.registry import read_hf_config, section_of

pytest.importorskip("transformers")


@pytest.mark.torch
def test_the_conformer_without_bounds_or_right_context_matches_transformers(tmp_path):
    """Transformers' defaults' shape (no rows after a query, use_clipped_linears false): the
    clips packed into a row within 1e-4 of transformers' padded batch."""
    source = hf_models.gemma4_audio(tmp_path / "m", right=0, clipped=False)
    result = check_dir(source)
    assert result["max_abs_ref"] > 0.5
    assert result["max_abs_diff"] < 1e-4, result


@pytest.mark.torch
def test_what_the_conformer_does_not_have_is_refused_naming_the_key(tmp_path):
    source = tmp_path / "m"
    hf_models.gemma4_audio(source)
    section = section_of("audio", read_hf_config(source), str(source))
    assert (section["stem"], section["mlp_dim"], section["n_mels"]) == ("conformer", 128, 16)
    assert data_section(str(source), audio=str(source))["mel"] == "gemma4"
    (source / "preprocessor_config.json").write_text(json.dumps({"per_bin_mean": [0.5] * 16}))
    with pytest.raises(FamilyError, match="per_bin_mean"):  # (features we do not compute)
        data_section(str(source), audio=str(source))
    hf = json.loads((source / "config.json").read_text())
    for key, value in (("hidden_act", "gelu"), ("attention_invalid_logits_value", -10.0)):
        (source / "config.json").write_text(json.dumps({**hf, key: value}))
        with pytest.raises(FamilyError, match=key):
            section_of("audio", read_hf_config(source), str(source))
    audio = {**section, "positions": "rope"}
    with pytest.raises(ConfigError, match="positions"):
        from_dict(Config, {"model": {"audio": audio}})
    with pytest.raises(ConfigError, match="mlp: the conformer's blocks"):
        from_dict(Config, {"model": {"audio": {**section, "mlp": "gated_silu"}}})


def test_a_fresh_conformers_state_is_finite():
    """No bound is the largest float32, not inf: a train step skips any update whose state is
    not finite (the checkpoint's ±inf round-trip through it: tests/test_hf.py's bit-identical
    export of `gemma4-audio`, whose light convolution's output is unbounded)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxmllm.models.conformer import ConformerEncoder
    from jaxmllm.models.layers import UNBOUNDED

    audio = {"stem": "conformer", "positions": "relative", "mlp": "silu", "n_mels": 16}
    audio.update(width=32, heads=4, mlp_dim=128, depth=2, conformer={"channels": [16, 8]})
    a = from_dict(Config, {"model": {"audio": audio}}).model.audio
    enc = ConformerEncoder(a, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    leaves = jax.tree.leaves(nnx.state(enc))
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
    assert np.asarray(enc.blocks.ff1.fc1.bounds[...]).tolist() == [[-UNBOUNDED, UNBOUNDED] * 2] * 2
