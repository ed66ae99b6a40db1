"""HuggingFace import, export and parity: transformers itself is the oracle.

Tiny random HF models are built locally in tmp_path (tests/hf_models.py: every parameter drawn
at random, so a norm or bias mapped wrong cannot hide behind HF's init of ones and zeros).
"""

from __future__ import annotations

import json

import hf_models
import jax
import numpy as np
import pytest
from flax import nnx

from jaxmllm.config import Config, from_dict
from jaxmllm.hf.check import check_dir
from jaxmllm.hf.export import export_role
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import model_section, write_config
from jaxmllm.hf.safetensors import Checkpoint, CheckpointError, write_checkpoint
from jaxmllm.hf.towers import config_for, load_towers
from sharding.rules import keyed_leaves

pytest.importorskip("transformers")

BUILD = {
    "llama-tied-llama3-scaling": lambda d: hf_models.llama(d, tied=True),
    "llama-untied": lambda d: hf_models.llama(d, tied=False, scaling=False),
    "qwen2-untied": lambda d: hf_models.qwen2(d, tied=False),
    "qwen2-tied": lambda d: hf_models.qwen2(d, tied=True),
    "siglip": hf_models.siglip,
    "clip": hf_models.clip,
    "qwen2-vl-vision": hf_models.qwen2_vl_vision,
    "qwen2-5-vl-vision": hf_models.qwen2_5_vl_vision,
    "qwen3-vl-vision": hf_models.qwen3_vl_vision,
    "whisper": hf_models.whisper,
    "qwen2-audio-encoder": hf_models.qwen2_audio_encoder,
    "gemma4-audio": hf_models.gemma4_audio,
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(BUILD))
def test_our_model_matches_transformers(name, tmp_path):
    """Logits (decoders: 64 tokens, 2-4 query heads per kv head, Qwen2's biases, tied and
    untied, Llama 3's rope scaling) or hidden states (SigLIP and CLIP, with its class token, at
    a non-square resolution off the table's grid; the Qwen2-VL and Qwen2.5-VL towers with 4
    images packed, Qwen2.5-VL's windows cutting some; Whisper and Qwen2-Audio's encoder, its
    rows pooled, with 2 clips packed; Gemma 4's conformer on 4 clips of lengths off its token
    and chunk grid, against transformers' batch with padding) within 1e-4 of transformers in
    fp32."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=64)
    assert result["max_abs_ref"] > 0.5  # a real signal, not zeros
    assert result["max_abs_diff"] < 1e-4, result


@pytest.mark.torch
def test_the_check_packs_several_inputs_into_a_row_or_gives_each_its_own(tmp_path):
    """`hf check` packs a causal LM's three texts into one row (positions restarting at each:
    "packed into 1 row"), or with --one-per-row gives each its own; both within 1e-4."""
    source = BUILD["qwen2-untied"](tmp_path / "m")
    packed, alone = check_dir(source), check_dir(source, packed=False)
    assert "3 texts" in packed["what"] and "packed into 1 row" in packed["what"], packed
    assert "each in a row of its own" in alone["what"], alone
    assert packed["max_abs_diff"] < 1e-4 and alone["max_abs_diff"] < 1e-4


@pytest.mark.torch
@pytest.mark.parametrize(
    "name",
    [
        "qwen2-tied",
        "siglip",
        "clip",
        "qwen2-5-vl-vision",
        "qwen3-vl-vision",
        "whisper",
        "qwen2-audio-encoder",
        "gemma4-audio",
    ],
)
def test_import_then_export_is_bit_identical(name, tmp_path):
    """Every HF tensor is consumed, every parameter filled (else the load raises), and writing
    the loaded parameters back gives the checkpoint's tensors bit for bit (CLIP's unused
    post_layernorm too)."""
    source = BUILD[name](tmp_path / "source")
    role = {"qwen2-tied": "llm", "siglip": "vision", "clip": "vision"}.get(
        name, "vision" if "vl" in name else "audio"
    )
    cfg = config_for(role, source)
    towers = load_towers(cfg, role)
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    export_role(cfg, role, flat, tmp_path / "out", 16 << 10)  # shards of 16 KiB: an index
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    before, after = Checkpoint(source), Checkpoint(tmp_path / "out")
    assert set(after.names()) == set(before.names())  # Whisper: its decoder comes back too
    for n in after.names():
        a, b = before.get(n), after.get(n)
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)), n
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"], config
    again = load_towers(config_for(role, str(tmp_path / "out")), role)  # from the shards
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))


@pytest.mark.torch
def test_a_tensor_with_no_place_is_refused_naming_it(tmp_path):
    source = tmp_path / "llama"
    hf_models.llama(source, tied=True)
    ck = Checkpoint(source)
    tensors = [(n, np.asarray(ck.get(n))) for n in ck.names()]
    tensors.append(("model.layers.0.self_attn.q_norm.weight", np.ones(16, np.float32)))
    write_checkpoint(source, tensors)
    with pytest.raises(FamilyError, match=r"q_norm\.weight"):
        load_towers(config_for("llm", str(source)), "llm")


@pytest.mark.torch
def test_a_missing_tensor_and_a_wrong_shape_are_refused_naming_them(tmp_path):
    source = tmp_path / "llama"
    hf_models.llama(source, tied=False)
    ck = Checkpoint(source)
    kept = [(n, np.asarray(ck.get(n))) for n in ck.names() if n != "lm_head.weight"]
    write_checkpoint(tmp_path / "missing", kept)
    (tmp_path / "missing" / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(FamilyError, match=r"no tensor lm_head\.weight"):
        load_towers(config_for("llm", str(tmp_path / "missing")), "llm")
    hf = json.loads((source / "config.json").read_text())
    hf["intermediate_size"] = 80  # the checkpoint's MLP is 96 wide
    (source / "config.json").write_text(json.dumps(hf))
    # Refused from the headers, before a parameter is allocated, naming the file and tensor.
    with pytest.raises(
        CheckpointError,
        match=r"mlp\.gate_proj\.weight \[96, 64\] in .*"
        r"model\.safetensors does not hold",
    ):
        load_towers(config_for("llm", str(source)), "llm")


def test_unsupported_architectures_and_options_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(FamilyError, match=r"model_type 'gpt2'.*llama, qwen2"):
        model_section(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "use_sliding_window": True, "hidden_size": 64})
    )
    with pytest.raises(FamilyError, match="sliding-window"):
        model_section(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip_vision_model"}))
    with pytest.raises(FamilyError, match="vision model: pass it as --vision"):
        model_section(str(tmp_path))


@pytest.mark.torch
def test_import_writes_a_config_the_trainer_loads(tmp_path):
    llm, vision, audio = (
        hf_models.qwen2(tmp_path / "llm", tied=True),
        hf_models.qwen2_vl_vision(tmp_path / "vision"),
        hf_models.whisper(tmp_path / "audio"),
    )
    out = tmp_path / "run.yaml"
    cfg = write_config(out, llm, vision, audio)
    assert out.read_text().startswith(f"# python -m jaxmllm.train --config {out}")
    m = cfg.model
    assert (m.llm.attn_bias, m.llm.heads, m.llm.kv_heads, m.llm.tied_logits_scaled) == (
        "qkv",
        8,
        2,
        False,
    )
    assert (m.vision.temporal_patch, m.vision.projector_dim, m.audio.stem) == (2, 128, "whisper")
    assert m.init_from.llm == str(tmp_path / "llm")
    assert isinstance(from_dict(Config, json.loads(json.dumps(_asdict(cfg)))), Config)


def _asdict(cfg):
    import dataclasses

    return dataclasses.asdict(cfg)


def test_whisper_log_mel_is_the_feature_extractors(tmp_path):
    """data.mel: whisper gives what WhisperFeatureExtractor gives a clip of its 30 s window."""
    from transformers import WhisperFeatureExtractor

    from jaxmllm.data.media.audio import whisper_log_mel

    rng = np.random.default_rng(0)
    t = np.arange(16000 * 7) / 16000
    x = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.normal(size=t.size)).astype(np.float32)
    theirs = WhisperFeatureExtractor(feature_size=80)(x, sampling_rate=16000, return_tensors="np")
    theirs = theirs.input_features[0].T[:700]
    np.testing.assert_allclose(whisper_log_mel(x, 16000, 80), theirs, atol=2e-5)


@pytest.mark.torch
def test_import_takes_the_processors_settings(tmp_path):
    llm = hf_models.qwen2(tmp_path / "llm", tied=True)
    vision = hf_models.qwen2_vl_vision(tmp_path / "vision")
    audio = hf_models.whisper(tmp_path / "audio")
    clip = {
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "min_pixels": 3136,
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "max_pixels": 12845056,
    }
    (tmp_path / "vision" / "preprocessor_config.json").write_text(json.dumps(clip))
    (tmp_path / "audio" / "preprocessor_config.json").write_text('{"sampling_rate": 16000}')
    cfg = write_config(tmp_path / "run.yaml", llm, vision, audio)
    d = cfg.data
    assert d.image_mean == tuple(clip["image_mean"]) and d.image_std == tuple(clip["image_std"])
    assert (d.image_min_pixels, d.image_max_pixels, d.mel) == (3136, 12845056, "whisper")
    assert d.audio_max_frames == 2 * 32  # Whisper's table of 32 rows, 2 frames a row


def test_mrope_positions_are_qwen2_vls():
    """Text counts on in all three; an image's tokens sit on its merged grid from the text's
    next position; the text after resumes at that position + the grid's longer side."""
    from jaxmllm.batch.bucketize import mrope_positions

    ids = np.array([1, 2, 9, 9, 9, 9, 9, 9, 3, 9, 4])  # a 4x6 grid (2x3 merged), a 2x2 one
    want = [
        [0, 0, 0],
        [1, 1, 1],
        [2, 2, 2],
        [2, 2, 3],
        [2, 2, 4],
        [2, 3, 2],
        [2, 3, 3],
        [2, 3, 4],
        [5, 5, 5],
        [6, 6, 6],
        [7, 7, 7],
    ]
    np.testing.assert_array_equal(mrope_positions(ids, 9, [(4, 6), (2, 2)], 2), want)
    with pytest.raises(ValueError, match="7 image tokens but .* 1 image grids merge to 6"):
        mrope_positions(ids, 9, [(4, 6)], 2)
    # Two images with no text between (synthetic samples, tokenizers without vision start/end
    # tokens): one run of image tokens, split by the grids in order.
    ids = np.array([1, 9, 9, 9, 9, 9, 9, 9, 4])
    want = [
        [0, 0, 0],
        [1, 1, 1],
        [1, 1, 2],
        [1, 1, 3],
        [1, 2, 1],
        [1, 2, 2],
        [1, 2, 3],
        [4, 4, 4],
        [5, 5, 5],
    ]
    np.testing.assert_array_equal(mrope_positions(ids, 9, [(4, 6), (2, 2)], 2), want)
