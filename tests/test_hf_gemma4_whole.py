"""Gemma 4's whole model (`gemma4`: its text decoder, its vision tower, embed_vision, images read
both ways in the sliding layers; its audio conformer and embed_audio) in and out, held to
transformers on a tiny random checkpoint built in tmp_path (tests/hf_models.py): `hf check`'s
logits with images and clips packed beside text, negative controls with the images read
causally or both ways in every layer and with embed_audio's norm at another epsilon, the tower
alone against Gemma4VisionModel, the bit-exact round trip, greedy ids with an image and a clip,
the processor's soft-token counts, the processor's image and clip wraps and what import
refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_chat import build_dir, hf
from test_generate_hf import VOCAB, _ours, hf_greedy, image_prompt
from test_hf_gemma3_whole import _check, _flat

from jaxmllm.data.media.image import patchify
from jaxmllm.data.params import Params
from jaxmllm.data.records.record import parse_record
from jaxmllm.data.text.tokenizer import make_tokenizer
from jaxmllm.hf import gemma4_vision, table
from jaxmllm.hf.export import Piece, write_piece
from jaxmllm.hf.family import FamilyError, bounds, mismatches
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.registry import read_hf_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.towers import load_model
from jaxmllm.hf.whole_config import TOWERS
from jaxmllm.hf.wholes import whole_for
from jaxmllm.models import encoders, projectors
from jaxmllm.models.layers import UNBOUNDED

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch
# Gemma4Processor's image tokens: begin, end, the soft token; its audio tokens alike
NAMES = ["<|image>", "<image|>", "<|image|>"]
AUDIO_NAMES = ["<|audio>", "<audio|>", "<|audio|>"]
AUDIO_IDS = (294, 295, 296)  # (begin, end, soft token of a clip in hf_models.gemma4's 300)


@pytest.mark.parametrize(
    "options",
    [{"clipped": True}, {"per_layer": 8, "shared": 2}],
    ids=["clipped-tower", "ple-shared"],
)
def test_gemma4_with_images_and_clips_packed_beside_text_matches_transformers(
    options, tmp_path, capsys
):
    """The LLM on text, the tower and its pooling projector on an image, the conformer and
    embed_audio on a clip, then two samples with an image (text, `<|image>`, six and two soft
    tokens, `<image|>`, text: the first longer than the window of 4), two with a clip (text,
    `<|audio>`, 10 and 14 soft tokens of 38 and 53 frames, `<audio|>`, text) and one of text
    alone packed into ONE row: every token's logits within 1e-4 of transformers on each
    sample alone in fp32, given its mm_token_type_ids, input_features and their mask; with
    the tower's linears clipped (their bounds biting, the down projections' ±inf); with
    per-layer inputs (an image's and a clip's soft tokens reading the pad token's row, their
    context part the media's rows) and the last two layers reusing keys too."""
    results = _check(hf_models.gemma4(tmp_path / "gemma4", audio=AUDIO_IDS, **options), capsys)
    assert [r["role"] for r in results] == ["llm", "vision", "audio"] + ["model"] * 5
    samples = [r["what"] for r in results[3:]]
    assert "6x4-patch image" in samples[0] and "2x4-patch image" in samples[3]
    assert "38-frame clip" in samples[1] and "53-frame clip" in samples[4]
    assert all("packed 5 samples into 1 row" in w for w in samples)
    for result in results:
        assert result["max_abs_ref"] > 0.5, result  # a real signal, not zeros
        assert result["max_abs_diff"] < 1e-4, result


def test_embed_audio_at_another_epsilon_fails_the_check(tmp_path, capsys, monkeypatch):
    """The negative control: embed_audio's RMSNorm at the vision embedder's epsilon (1e-6)
    instead of the audio config's rms_norm_eps (0.05): the clips' rows and the samples with a
    clip are off transformers', the images and text alone are not."""

    def other_eps(cfg, **kw):
        a = cfg.audio
        return projectors.PoolProjector(
            a.out_width, cfg.llm.width, 1, norm_eps=1e-6, embed=True, **kw
        )

    monkeypatch.setitem(encoders.ENCODER_MODULES, "audio", (encoders.audio_encoder, other_eps))
    results = _check(hf_models.gemma4(tmp_path / "gemma4", audio=AUDIO_IDS), capsys, rc=1)
    clip = [r for r in results if "clip" in r["what"]]
    rest = [r for r in results if "clip" not in r["what"]]
    assert len(clip) == 3 and min(r["max_abs_diff"] for r in clip) > 1e-2, clip
    assert len(rest) == 5 and all(r["max_abs_diff"] < 1e-4 for r in rest), rest


@pytest.mark.parametrize(
    "read",
    [
        "causally",
        pytest.param("both ways in every layer", marks=pytest.mark.slow),
        pytest.param("with the clipped linears' bounds ignored", marks=pytest.mark.slow),
    ],
)
def test_images_read_otherwise_fail_the_check(tmp_path, capsys, monkeypatch, read):
    """The negative controls: imported with the images read causally (no spans), or both ways
    in the full layers too (Gemma 3's rule), the samples with an image are off transformers'
    (its images both ways in the sliding layers only) and text alone is not; so too with the
    tower's clipped linears read as unbounded."""
    d = hf_models.gemma4(tmp_path / "gemma4", clipped="bounds" in read)
    whole = whole_for(read_hf_config(d))
    if read == "causally":
        monkeypatch.setattr(whole, "row", dataclasses.replace(table.GEMMA4, bidirectional=()))
    elif "bounds" in read:
        none = np.asarray([-UNBOUNDED, UNBOUNDED] * 2, np.float32)

        def ignored(hf, ours, layers):  # (every layer's bounds read as none)
            return dataclasses.replace(bounds(hf, ours, layers), to_ours=lambda *b: (none,))

        monkeypatch.setattr(gemma4_vision, "bounds", ignored)
    else:
        section = whole.section

        def every(role, hf):  # (the full layers read the spans both ways too)
            out = section(role, hf)
            return {**out, "bidirectional_full": True} if role == "llm" else out

        monkeypatch.setattr(whole, "section", every)
    results = _check(d, capsys, rc=1)
    image = [r for r in results[2:] if "image" in r["what"]]
    text = [r for r in results if "image" not in r["what"]]
    assert len(image) == 2 and max(r["max_abs_diff"] for r in image) > 1e-2, image
    assert all(r["max_abs_diff"] < 1e-4 for r in text), text


@pytest.mark.slow  # (a check compiled for the control alone; the positive case is fast)
def test_soft_tokens_reading_their_own_per_layer_rows_fail_the_check(tmp_path, capsys, monkeypatch):
    """The negative control of the per-layer inputs' ids: an image's soft tokens reading the
    per-layer row of their own id (the image token's), not the pad token's as transformers'
    Gemma4Model reads them, put the samples with an image off transformers' and text alone
    not."""
    from jaxmllm.models import mllm

    d = hf_models.gemma4(tmp_path / "gemma4", per_layer=8, shared=2)
    monkeypatch.setattr(mllm, "per_layer_ids", lambda tokens, slots, pad: tokens)
    jax.clear_caches()
    try:
        results = _check(d, capsys, rc=1)
    finally:
        jax.clear_caches()
    image = [r for r in results[2:] if "image" in r["what"]]
    text = [r for r in results if "image" not in r["what"]]
    assert len(image) == 2 and max(r["max_abs_diff"] for r in image) > 1e-2, image
    assert all(r["max_abs_diff"] < 1e-4 for r in text), text


def test_gemma4_tower_alone_matches_gemma4_vision_model(tmp_path):
    """Gemma 4's tower (its linears clipped, the bounds biting) on a 6x4-patch image, its
    patches in our merge order with their (column, row) positions: every patch's features are
    Gemma4VisionEncoder's, and our pooled, scaled and standardised rows Gemma4VisionModel's
    output, within 1e-5 (of their size too) in fp32; the bounds get no gradient (never
    trained), the kernels do; with the bounds made none, the features are far off."""
    import torch
    from flax import nnx
    from transformers import Gemma4ForConditionalGeneration

    d = hf_models.gemma4(tmp_path / "gemma4", clipped=True)
    cfg, model = load_model(d, d)
    v = cfg.model.vision
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (6 * v.patch_size, 4 * v.patch_size, 3), dtype=np.uint8)
    patches, positions = patchify(pixels, v.patch_size, v.merge)
    seg = jnp.ones((1, len(patches)), jnp.int32)
    args = (jnp.asarray(patches)[None], seg, jnp.asarray(positions)[None])
    ours = model.vision(*args)[0]

    tower = Gemma4ForConditionalGeneration.from_pretrained(d).eval().model.vision_tower
    captured = {}
    tower.encoder.register_forward_hook(lambda m, i, o: captured.update(out=o))
    with torch.no_grad():
        out = tower(
            pixel_values=torch.from_numpy(patches[None] / 255.0).float(),
            pixel_position_ids=torch.from_numpy(positions[None, :, ::-1].copy()).long(),
        )
    theirs = captured["out"].last_hidden_state[0].numpy()
    assert np.abs(theirs).max() > 0.5
    # (1e-5 of their size too: features up to 6, where fp32 rounds ours and theirs 1e-5 apart,
    # each within 1e-5 of transformers in float64, clipped or not)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=1e-5)

    p = model.vision_projector
    pooled = np.asarray(ours).reshape(-1, v.merge**2, v.width).mean(1) * np.sqrt(v.width)
    pooled = (pooled - np.asarray(p.std_bias[...])) * np.asarray(p.std_scale[...])
    # (the pooled rows are sqrt(width) times the features' mean, then standardised: the
    # features' 1e-5 carried through that scale; 1e-5 of their size too)
    tol = 1e-5 * np.sqrt(v.width)
    np.testing.assert_allclose(pooled, out.last_hidden_state.numpy(), atol=tol, rtol=1e-5)

    grads = nnx.grad(lambda t: t(*args).sum())(model.vision).transformer.blocks.attn.query
    assert not np.asarray(grads.bounds[...]).any() and np.asarray(grads.kernel[...]).all()
    clipped = [m for _, m in nnx.iter_graph(model.vision) if getattr(m, "bounds", None)]
    assert len(clipped) == 7  # (q, k, v, o, gate, up, down)
    for matrix in clipped:
        matrix.bounds[...] = jnp.broadcast_to(
            jnp.asarray([-UNBOUNDED, UNBOUNDED] * 2), matrix.bounds.shape
        )
    assert np.abs(np.asarray(model.vision(*args)[0]) - theirs).max() > 1e-2


def test_gemma4_import_then_export_is_bit_identical(tmp_path, monkeypatch):
    """Every tensor of the whole checkpoint (its conformer and embed_audio too) is consumed,
    and writing the loaded parameters back gives each bit for bit (the clipped linears' bounds,
    the vision tower's and the conformer's, ±inf too), with a config.json transformers loads
    without a missing or an unexpected key; the import sets the towers' options and the spans
    of the sliding layers. Exported from scratch, its processor is Gemma4Processor
    (`_from_scratch_processor`)."""
    import transformers
    from flax import nnx

    from sharding.rules import keyed_leaves

    tk = _gemma4_tokenizer(tmp_path / "tk")
    ids = transformers.AutoTokenizer.from_pretrained(str(tk)).convert_tokens_to_ids(
        NAMES + AUDIO_NAMES
    )
    source = hf_models.gemma4(
        tmp_path / "source", vocab=512, ids=ids[:3], audio=ids[3:], clipped=True
    )
    write_config(tmp_path / "run.yaml", model=source)  # (its ±inf bounds: not refused)
    cfg, model = load_model(source, source, source)
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(model)))
    a = cfg.model.audio
    assert (a.stem, a.projector, a.norm_eps, cfg.data.mel) == ("conformer", "embed", 0.05, "gemma4")
    v, llm = cfg.model.vision, cfg.model.llm
    assert (v.projector, v.pool_embed, v.standardize, v.merge) == ("pool", True, True, 2)
    assert (v.rope_axes, v.position_axes, v.final_norm, v.clipped_linears) == (
        "cols_first",
        16,
        False,
        True,
    )
    for tower in TOWERS:  # (the other vision towers have no bounds to write: they refuse it)
        off = mismatches(cfg, tower.wants(cfg), tower.name)
        clipped = any(m.startswith("model.vision.clipped_linears=True") for m in off)
        assert clipped == (tower.role == "vision" and tower.name != "gemma4_vision"), tower.name
    assert (llm.bidirectional, llm.bidirectional_full) == (("vision",), False)
    assert (cfg.data.image_resize, cfg.data.image_max_pixels) == ("floor", 280 * 8 * 8)
    out = tmp_path / "out"
    whole = whole_for(read_hf_config(source))
    roles = ("llm", "vision", "audio")
    write_piece(cfg, Piece("", roles, source, whole=whole), flat, out, 16 << 10)
    before, after = Checkpoint(source), Checkpoint(out)
    assert set(after.names()) == set(before.names())
    assert any(n.startswith("model.embed_audio.") for n in after.names())
    for n in after.names():
        x, y = before.get(n), after.get(n)
        bits = lambda t: t.reshape(-1).view(np.uint8)  # (a clipped linear's bound: 0-d)
        assert x.dtype == y.dtype and np.array_equal(bits(x), bits(y)), n
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["use_bidirectional_attention"] == "vision"
    source_config = json.loads((Path(source) / "config.json").read_text())
    assert config["audio_config"] == source_config["audio_config"]
    assert config["vision_config"]["use_clipped_linears"] is True
    cls = transformers.Gemma4ForConditionalGeneration
    _, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    again = keyed_leaves(nnx.to_pure_dict(nnx.state(load_model(str(out), str(out), str(out))[1])))
    assert all(np.array_equal(flat[k], again[k]) for k in flat)
    _from_scratch_processor(cfg, flat, source, tk, tmp_path / "scratch", monkeypatch)


def test_import_refuses_what_gemma4_sets_and_jaxmllm_does_not_build(tmp_path):
    """An audio tower not Gemma 4's conformer and a processor that normalises, each refused
    naming its key."""
    d = Path(hf_models.gemma4(tmp_path / "gemma4"))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "audio_config": {"model_type": "x"}}))
    with pytest.raises(FamilyError, match="audio_config"):
        write_config(tmp_path / "run.yaml", model=str(d))
    (d / "config.json").write_text(json.dumps(config))
    processor = {"image_processor_type": "Gemma4ImageProcessor", "do_normalize": True}
    (d / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(FamilyError, match="do_normalize"):
        write_config(tmp_path / "run.yaml", model=str(d))


@pytest.mark.parametrize("sizes", [(4, 2, 70), (16, 3, 280)])
def test_an_images_soft_tokens_are_the_processors(tmp_path, sizes):
    """Images of many sizes and shapes (tiny, long, large, upscaled): the soft tokens our data
    pipeline counts for each (what the balancer prices), at the data keys `hf import` reads off
    the processor's file, are Gemma4ImageProcessor's, at a tiny processor's sizes and at Gemma
    4's defaults (16-pixel patches, 3x3 pooling, 280 soft tokens)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    p, k, tokens = sizes
    d = Path(hf_models.gemma4(tmp_path / "gemma4", patch=p, pool=k))
    proc = {"patch_size": p, "pooling_kernel_size": k, "max_soft_tokens": tokens}
    file = {"image_processor_type": "Gemma4ImageProcessor", **proc}
    (d / "preprocessor_config.json").write_text(json.dumps(file))
    cfg, _ = _flat(str(d))
    keys = ("image_resize", "image_min_pixels", "image_max_pixels")
    params = dataclasses.replace(
        Params.from_config(cfg), patch_size=p, merge=k, **{x: getattr(cfg.data, x) for x in keys}
    )
    assert cfg.data.image_max_pixels == tokens * (p * k) ** 2
    shapes = [(3, 5), (37, 90), (90, 37), (224, 224), (1, 700), (480, 640), (2000, 33), (17, 17)]
    images = [Image.fromarray(np.zeros((h, w, 3), np.uint8)) for h, w in shapes]
    out = Gemma4ImageProcessorPil(**proc)(images, return_tensors="np")
    theirs = [int(n) for n in out["num_soft_tokens_per_image"]]
    grids = [params.patch_grid(h, w) for h, w in shapes]
    assert [gh * gw // k**2 for gh, gw in grids] == theirs


def test_gemma4_with_an_image_and_a_clip_generates_transformers_tokens(tmp_path):
    """A whole Gemma 4 from one directory, an image in the prompt between `<|image>` and
    `<image|>` (read both ways in the sliding layers in prefill, as transformers'
    mm_token_type_ids read it), then a clip of 38 frames (10 soft tokens, its last 2 frames
    padding at position -1) between `<|audio>` and `<audio|>`: the 16 greedy ids are
    transformers'."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    d = tmp_path / "gemma4"
    template = "meta-llama/Llama-3.1-8B-Instruct"
    extra = NAMES + AUDIO_NAMES
    options = dict(image_token=NAMES[2], boi_token=NAMES[0], eoi_token=NAMES[1])
    options.update(audio_token=AUDIO_NAMES[2], boa_token=AUDIO_NAMES[0], eoa_token=AUDIO_NAMES[1])
    tk = hf(build_dir(d, "llama", template, extra=extra, **options))
    boi, eoi, image_id, boa, eoa, audio_id = (tk.convert_tokens_to_ids(t) for t in extra)
    hf_models.gemma4(d, vocab=VOCAB, ids=(boi, eoi, image_id), seed=1, audio=(boa, eoa, audio_id))
    build_dir(d, "llama", template, extra=extra, **options)  # (save_pretrained wrote over it)

    g, p, k = 6, 4, 2  # 6x6 patches of 4 px, 2x2 of them a soft token
    image, tokens, _ = image_prompt(tk, g, p, k, image_id, (boi, eoi))
    frames, mels = 38, 16
    clip = np.random.default_rng(1).normal(size=(40, mels)).astype(np.float32)
    at = np.where(np.arange(40) < frames, np.arange(40), -1).astype(np.int32)
    tokens = [*tokens, boa, *[audio_id] * 10, eoa]
    media = {**image.media, "audio": [(clip, at)]}
    prompt = dataclasses.replace(
        image, tokens=np.asarray(tokens, np.int32), loss=np.zeros(len(tokens), bool), media=media
    )
    ours, stop = _ours(d, prompt, 16)

    model = Gemma4ForConditionalGeneration.from_pretrained(str(d)).eval()
    patches, positions = prompt.media["vision"][0]
    pixels = torch.from_numpy(patches[None] / 255.0).float()
    where = torch.from_numpy(positions[None, :, ::-1].copy()).long()
    types = torch.tensor([[int(t == image_id) for t in tokens]])
    theirs = hf_greedy(
        model,
        tokens,
        16,
        stop,
        pixel_values=pixels,
        image_position_ids=where,
        mm_token_type_ids=types,
        input_features=torch.from_numpy(clip[None, :frames]),
        input_features_mask=torch.ones(1, frames, dtype=torch.bool),
    )
    assert len(ours) == 16 and ours == theirs


def test_an_image_and_a_clip_are_wrapped_as_gemma4s_processor_wraps_them(tmp_path):
    """A tokenizer naming Gemma 4's image and audio tokens (image_token, boi_token, eoi_token;
    audio_token, boa_token, eoa_token): an image becomes `<|image>`, its placeholder (one a
    row, laid out later) and `<image|>`, a clip `<|audio>`, its placeholder and `<audio|>`,
    nothing around them, as Gemma4Processor's replace_image_token and replace_audio_token
    write them."""
    options = dict(image_token=NAMES[2], boi_token=NAMES[0], eoi_token=NAMES[1])
    options.update(audio_token=AUDIO_NAMES[2], boa_token=AUDIO_NAMES[0], eoa_token=AUDIO_NAMES[1])
    d = build_dir(tmp_path / "tk", "llama", None, NAMES + AUDIO_NAMES, **options)
    tk = make_tokenizer(str(d))
    raw = {"id": "a", "text": "hi<image>ok<audio>end", "images": ["y"], "audio": ["z"]}
    pieces = tk.pieces(parse_record(raw, Path("."), 1))
    assert [p[0] for p in pieces] == ["text", "vision", "text", "audio", "text"]
    before, between, after = pieces[0][1], pieces[2][1], pieces[4][1]
    boi, eoi, boa, eoa = (tk.token_id(t) for t in [*NAMES[:2], *AUDIO_NAMES[:2]])
    assert before[-1] == boi and tk.decode(before[:-1]).endswith("hi"), tk.decode(before)
    assert between[0] == eoi and between[-1] == boa, tk.decode(between)
    assert tk.decode(between[1:-1]).strip() == "ok", tk.decode(between)
    assert after[0] == eoa and tk.decode(after[1:]).startswith("end"), tk.decode(after)
    assert tk.specials.media["vision"] == tk.token_id(NAMES[2])
    assert tk.specials.media["audio"] == tk.token_id(AUDIO_NAMES[2])


def _gemma4_tokenizer(directory: Path) -> Path:
    """A tokenizer directory naming Gemma 4's image and audio tokens, a Llama 3.1 chat template
    in its tokenizer_config.json."""
    options = dict(image_token=NAMES[2], boi_token=NAMES[0], eoi_token=NAMES[1])
    options.update(audio_token=AUDIO_NAMES[2], boa_token=AUDIO_NAMES[0], eoa_token=AUDIO_NAMES[1])
    template = "meta-llama/Llama-3.1-8B-Instruct"
    return build_dir(directory, "llama", template, NAMES + AUDIO_NAMES, **options)


def _from_scratch_processor(cfg, flat, source: str, d: Path, out: Path, monkeypatch) -> None:
    """The run `cfg` (its parameters `flat`, their architecture `source`'s) exported from
    scratch with the tokenizer `d` (no imported directory: the processor's file made from the
    data section, beside the run's tokenizer and chat template): AutoProcessor builds
    Gemma4Processor from it, with the image processor and the feature extractor at our
    settings; a chat with an image and a clip, the template rendered by the processor, comes
    out as our tokenizer lays it out (`<|image>`, one soft token per pooled window of the image
    resized as we resize it, `<image|>`, `<|audio>`, one per 4 frames of the clip, `<audio|>`),
    its clip's features ours (`data.mel: gemma4`) within 2e-4; and `hf import` reads the
    export's processor back into the run's data keys."""
    from PIL import Image

    from jaxmllm.data.media.audio import gemma4_log_mel
    from jaxmllm.hf.importer import data_section

    budget = 70 * 8 * 8  # (the fewest soft tokens an image may have: 70 pooled windows)
    data = dict(tokenizer=str(d), image_min_pixels=budget, image_max_pixels=budget)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))
    whole = whole_for(read_hf_config(source))
    write_piece(cfg, Piece("", ("llm", "vision", "audio"), "", whole=whole), flat, out, 1 << 30)
    saved = json.loads((out / "processor_config.json").read_text())
    assert saved["video_processor"]["video_processor_type"] == "Gemma4VideoProcessor"

    processor = _gemma4_processor(out, monkeypatch)
    assert type(processor).__name__ == "Gemma4Processor"
    assert type(processor.feature_extractor).__name__ == "Gemma4AudioFeatureExtractor"
    assert processor.image_processor.max_soft_tokens == 70
    rng = np.random.default_rng(0)
    shape, samples, rate = (30, 50), 16123, cfg.data.audio_sample_rate
    image = Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8))
    clip = (0.3 * rng.standard_normal(samples)).astype(np.float32)
    content, reply = "hi{}ok{}end", {"role": "assistant", "content": "a cat"}
    chat = [{"role": "user", "content": content.format(NAMES[2], AUDIO_NAMES[2])}, reply]
    text = processor.apply_chat_template(chat, tokenize=False)
    theirs = processor(  # (one chat: no padding, which this tokenizer has no token for)
        text=text,
        images=[image],
        audio=[clip],
        add_special_tokens=False,
        padding=False,
        return_tensors="np",
    )

    tk = make_tokenizer(str(d))
    user = {"role": "user", "content": content.format("<image>", "<audio>")}
    raw = {"id": "a", "messages": [user, reply], "images": ["y"], "audio": ["z"]}
    record = parse_record(raw, Path("."), 1)
    params = Params.from_config(cfg)
    grid = params.patch_grid(*shape)
    counts = {"vision": grid[0] * grid[1] // cfg.model.vision.merge**2}
    counts["audio"] = params.clip_chunks(samples, rate)[0] // cfg.model.audio.subsample
    ours = []
    for kind, piece, *_ in tk.pieces(record):
        ours += piece.tolist() if kind == "text" else [tk.specials.media[kind]] * counts[kind]
    assert counts["vision"] > 1 and counts["audio"] > 1
    assert theirs["input_ids"][0].tolist() == ours

    features = gemma4_log_mel(clip, rate, cfg.model.audio.n_mels)
    mask = theirs["input_features_mask"][0]
    assert mask.sum() == len(features) and mask[: len(features)].all()
    np.testing.assert_allclose(theirs["input_features"][0][: len(features)], features, atol=2e-4)

    back = data_section(str(out), str(out), str(out))
    for key in ("image_resize", "image_min_pixels", "image_max_pixels", "mel"):
        assert back[key] == getattr(cfg.data, key), key
    assert back["audio_sample_rate"] == rate
    assert tuple(back["image_mean"]) == tuple(cfg.data.image_mean)

    # (without audio too: Gemma4Processor has a feature extractor either way)
    audio = dataclasses.replace(cfg.model.audio, enabled=False)
    silent = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, audio=audio))
    plain = out.with_name("no_audio")
    write_piece(silent, Piece("", ("llm", "vision"), "", whole=whole), flat, plain, 1 << 30)
    assert type(_gemma4_processor(plain, monkeypatch)).__name__ == "Gemma4Processor"


class _NoVideos(dict):
    """The video processor Gemma4Processor is given where torchvision, which its own needs, is
    not installed: its settings from the processor's file, nothing to run (the chat has no
    video)."""


def _gemma4_processor(directory, monkeypatch):
    """AutoProcessor's Gemma4Processor of `directory`. Without torchvision (CPU CI) a stand-in
    for its video processor alone; the rest (the processor's file, its image processor,
    feature extractor, tokenizer and chat template) is read as AutoProcessor reads it."""
    import importlib.util

    from transformers import AutoProcessor, ProcessorMixin

    if importlib.util.find_spec("torchvision") is None:
        from transformers.models.auto import video_processing_auto

        auto = video_processing_auto.AutoVideoProcessor
        saved = json.loads((Path(directory) / "processor_config.json").read_text())
        videos = _NoVideos(saved["video_processor"])
        monkeypatch.setattr(auto, "from_pretrained", classmethod(lambda *a, **k: videos))
        check = ProcessorMixin.check_argument_for_proper_class

        def proper(self, name, argument):
            return None if name == "video_processor" else check(self, name, argument)

        monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", proper)
    return AutoProcessor.from_pretrained(str(directory))
