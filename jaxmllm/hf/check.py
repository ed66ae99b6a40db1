"""`python -m jaxmllm.hf check DIR`: our model from a HF directory against transformers itself.

Builds the module the checkpoint fills (`towers`), runs it and the transformers model on the
same random inputs in fp32, and reports the largest difference: of the logits for a decoder
(three samples packed into one row as training packs them, each held to transformers run on
it alone),
of the last hidden states for SigLIP and Whisper, of the patch merger's output for the Qwen2-VL
vision tower. Images are non-square and at a resolution other than the checkpoint's (SigLIP's
table is resized), several packed in one row (Qwen2-VL); clips are several, packed. Needs torch
and transformers (`pip install -e '.[dev]'`).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config import Config
from jaxmllm.data.media.image import patchify
from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.hf.registry import family_for, read_hf_config, roles_of
from jaxmllm.hf.towers import Towers, config_for, load_towers
from jaxmllm.hf.wholes import WHOLES

HF_MODULES = {  # (model_type, role) -> (transformers class, path to the module compared)
    ("llama", "llm"): ("LlamaForCausalLM", ""),
    ("qwen2", "llm"): ("Qwen2ForCausalLM", ""),
    ("qwen3", "llm"): ("Qwen3ForCausalLM", ""),
    ("qwen2_moe", "llm"): ("Qwen2MoeForCausalLM", ""),
    ("qwen3_moe", "llm"): ("Qwen3MoeForCausalLM", ""),
    ("qwen3_5_text", "llm"): ("Qwen3_5ForCausalLM", ""),
    ("qwen3_5_moe_text", "llm"): ("Qwen3_5MoeForCausalLM", ""),
    ("siglip_vision_model", "vision"): ("SiglipVisionModel", ""),
    ("siglip", "vision"): ("SiglipModel", "vision_model"),
    ("clip_vision_model", "vision"): ("CLIPVisionModel", ""),
    ("clip", "vision"): ("CLIPModel", "vision_model"),
    ("qwen2_vl_vision", "vision"): ("Qwen2VisionTransformerPretrainedModel", ""),
    ("qwen2_5_vl_vision", "vision"): ("Qwen2_5_VisionTransformerPretrainedModel", ""),
    ("whisper", "audio"): ("WhisperModel", "encoder"),
    ("qwen2_audio_encoder", "audio"): ("Qwen2AudioEncoder", ""),
}
for _whole in WHOLES:  # a whole checkpoint: its class (`check_whole` reads its parts)
    HF_MODULES[_whole.model_types[0], "llm"] = (_whole.hf_class, "")
MODULES = {  # where transformers keeps the classes it does not export at the top level
    "Qwen2VisionTransformerPretrainedModel": "qwen2_vl",
    "Qwen2_5_VisionTransformerPretrainedModel": "qwen2_5_vl",
    "Qwen2AudioEncoder": "qwen2_audio",
}


def role_of(hf: dict) -> str:
    """The role a checkpoint plays, from its model_type."""
    roles = roles_of(hf)
    if not roles:
        raise FamilyError(
            f"model_type {hf.get('model_type')!r} is not an architecture jaxmllm reads"
        )
    return roles[0]


def check_dir(directory: str, role: str = "", tokens: int = 64, seed: int = 0) -> dict:
    """Compares our module with transformers' on random inputs; returns the figures.

    Returns:
      {"role", "family", "what", "max_abs_diff", "max_abs_ref"}.
    """
    hf = read_hf_config(directory)
    role = role or role_of(hf)
    family = family_for(role, hf, directory)
    cfg = config_for(role, directory)
    towers = load_towers(cfg, role)
    reference = hf_module(directory, hf, role)
    rng = np.random.default_rng(seed)
    run = {"llm": _llm, "vision": _vision, "audio": _audio}[role]
    what, ours, theirs = run(towers, reference, cfg, family, rng, tokens)
    return figures(role, family.name, what, ours, theirs)


def figures(role: str, family: str, what: str, ours, theirs) -> dict:
    """The figures of a comparison: the largest difference and the largest reference value."""
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    return {
        "role": role,
        "family": family,
        "what": what,
        "max_abs_diff": float(np.abs(ours - theirs).max()),
        "max_abs_ref": float(np.abs(theirs).max()),
    }


def own_columns(ours, theirs, what: str) -> tuple[np.ndarray, str]:
    """Our logits over the checkpoint's own vocabulary, and `what` saying so where it differs.

    A checkpoint whose vocabulary is full (its tokenizer's tokens fill `vocab_size`) is grown by
    `hf import` for the placeholder tokens jaxmllm adds (`importer.vocab_size`, to a multiple of
    128); transformers' model has no columns for those rows, so the comparison is over the
    checkpoint's own. An export writes every row, the added ones included, and sets
    vocab_size to ours: importing the export again grows nothing."""
    ours = np.asarray(ours)
    have, grown = np.shape(theirs)[-1], ours.shape[-1]
    if grown == have:
        return ours, what
    return ours[..., :have], (
        f"{what} over the checkpoint's {have} vocabulary columns (the {grown - have} rows the "
        f"import added for placeholder tokens are ours alone; an export writes them, "
        f"vocab_size {grown})"
    )


def hf_module(directory: str, hf: dict, role: str):
    """The transformers module to compare with, fp32, in eval mode."""
    try:
        import torch
        import transformers
    except ImportError:
        raise FamilyError(
            "hf check needs torch and transformers: pip install -e '.[dev]' "
            "(torch==2.13.0 is the CPU build)"
        ) from None
    name, attr = HF_MODULES[hf["model_type"], role]
    cls = getattr(transformers, name, None)
    if cls is None:  # (a vision tower or audio encoder not exported at the top level)
        import importlib

        module = MODULES[name]
        cls = getattr(
            importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name
        )
    model = cls.from_pretrained(directory, dtype=torch.float32).eval()
    for part in filter(None, attr.split(".")):
        model = getattr(model, part)
    return model


def _torch(x: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(x))


def _numpy(t) -> np.ndarray:
    return t.detach().float().numpy()


def _llm(towers: Towers, ref, cfg: Config, family: Family, rng, tokens: int):
    """The decoder on one packed row, as training runs it: `tokens` random ids in three
    samples of unequal lengths and a little padding, segment ids and positions restarting at
    each; transformers runs each sample alone. Every sample's logits are compared."""
    import torch

    vocab = min(cfg.model.llm.vocab_size, ref.config.vocab_size)  # (the checkpoint's own ids)
    lengths = packed_lengths(tokens)
    samples = [rng.integers(0, vocab, n) for n in lengths]
    with torch.no_grad():
        theirs = np.concatenate([_numpy(ref(input_ids=_torch(x[None])).logits)[0] for x in samples])
    pad = 5
    ids = np.concatenate([*samples, np.zeros(pad, np.int64)])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate([*lengths, pad])])[None]
    segments[segments == len(lengths) + 1] = 0
    positions = np.concatenate([np.arange(n) for n in [*lengths, pad]])[None]
    if any(cfg.model.llm.mrope_section):  # text alone: time, row and column all count on
        positions = np.repeat(positions[..., None], 3, axis=-1)
    ours = _decode(towers, *map(jnp.asarray, (ids, segments, positions)))
    what = f"logits of {tokens} tokens, {len(lengths)} samples packed into 1 row"
    ours, what = own_columns(np.asarray(ours)[0, :tokens], theirs, what)
    return what, ours, theirs


def packed_lengths(tokens: int) -> list[int]:
    """Three samples' lengths adding up to `tokens` (at least 3), none alike."""
    first, second = max(tokens // 2, 1), max(tokens // 3, 1)
    return [first, second, tokens - first - second] if tokens - first - second > 0 else [tokens]


# One compiled program each (op by op, a tower compiles dozens of small ones).
_decode = nnx.jit(lambda t, ids, seg, pos: t.llm(t.llm.embed(ids), seg, pos))
_encode_images = nnx.jit(lambda t, patches, seg, pos: t.vision(patches, seg, pos))
_project = nnx.jit(lambda t, feats: t.vision_projector(feats))
_encode_audio = nnx.jit(lambda t, frames, seg, pos: t.audio(frames, seg, pos))


def _images(cfg: Config, rng, grids: list[tuple[int, int]]) -> list[np.ndarray]:
    p, c = cfg.model.vision.patch_size, cfg.model.vision.channels
    return [rng.normal(size=(h * p, w * p, c)).astype(np.float32) for h, w in grids]


def _vision(towers: Towers, ref, cfg: Config, family: Family, rng, tokens: int):
    import torch

    v = cfg.model.vision
    m = v.merge
    if v.positions == "learned":  # SigLIP, CLIP: one non-square image off the table's grid
        g = v.position_grid
        grids = [((g + m) // m * m, max(m, (g - m) // m * m))]  # taller, narrower
    else:  # (windows: an image of several, some cut by its edge)
        w = max(v.window, m)
        grids = [(2 * m, 3 * m), (m, 2 * m), (3 * m, m), (2 * w + m, w + m)]
    images = _images(cfg, rng, grids)
    packed = [patchify(img, v.patch_size, m) for img in images]
    patches = np.concatenate([x for x, _ in packed])[None]
    positions = np.concatenate([pos for _, pos in packed])[None]
    segments = np.concatenate([np.full(len(x), i + 1) for i, (x, _) in enumerate(packed)])[None]
    feats = _encode_images(towers, *map(jnp.asarray, (patches, segments, positions)))
    with torch.no_grad():
        if v.positions == "learned":
            pixels = _torch(images[0].transpose(2, 0, 1)[None])
            theirs = _numpy(
                ref(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
            )[0, int(v.class_token) :]  # (CLIP: its class token first)
            h, w = grids[0]
            raster = positions[0, :, 0] * w + positions[0, :, 1]  # ours are in merge order
            return (f"hidden states of a {h}x{w}-patch image", np.asarray(feats)[0], theirs[raster])
        t, p, c = v.temporal_patch, v.patch_size, v.channels
        frames = patches[0].reshape(-1, p, p, c).transpose(0, 3, 1, 2)[:, :, None]
        pixels = np.repeat(frames, t, axis=2).reshape(len(frames), -1)
        grid_thw = torch.tensor([[1, h, w] for h, w in grids])
        out = ref(hidden_states=_torch(pixels), grid_thw=grid_thw)
        theirs = _numpy(out.pooler_output)
    ours = np.asarray(_project(towers, feats))[0]
    return f"merger output of {len(grids)} packed images", ours, theirs


def _audio(towers: Towers, ref, cfg: Config, family: Family, rng, tokens: int):
    import torch

    a = cfg.model.audio
    frames = a.max_positions * a.stride  # Whisper takes whole windows only
    clips = rng.normal(size=(2, frames, a.n_mels)).astype(np.float32)
    packed = clips.reshape(1, -1, a.n_mels)
    segments = np.repeat([1, 2], frames)[None]
    positions = np.tile(np.arange(frames), 2)[None]
    ours = _encode_audio(towers, *map(jnp.asarray, (packed, segments, positions)))
    with torch.no_grad():
        theirs = _numpy(ref(_torch(clips.transpose(0, 2, 1))).last_hidden_state)
    rows = math.prod(theirs.shape[:2])
    return (
        "hidden states of 2 packed clips",
        np.asarray(ours).reshape(rows, -1),
        theirs.reshape(rows, -1),
    )


def describe(result: dict[str, Any]) -> str:
    return (
        f"{result['family']} {result['role']}: {result['what']}: largest difference "
        f"{result['max_abs_diff']:.3g} (values up to {result['max_abs_ref']:.3g})"
    )
