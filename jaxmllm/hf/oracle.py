"""What transformers is given for one of our samples: the oracle's inputs, per whole family.

`hf check` compares our logits of a sample (its tokens, its images' patches, its videos'
temporal patches, its clips' frames, as `jaxmllm.data.preprocess` makes them or `hf check`
draws them) with transformers' on the same sample alone, so each family says here how a
`Sample` becomes its transformers model's keyword arguments (numpy arrays; the caller makes
them tensors):

- a causal LM: `input_ids` only;
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `pixel_values` / `pixel_values_videos` (each patch as its
  processor lays it out: channels, frames, rows, columns; an image's frame repeated to the
  temporal patch), `image_grid_thw` / `video_grid_thw` from the sample's grids, the token types
  (`mm_token_type_ids`: 1 image, 2 video), Qwen2.5-VL's `second_per_grid_ts`;
- LLaVA: `pixel_values` [images, channels, H, W], each image whole again from its patches (at
  its tower's own size: transformers' CLIP and SigLIP take no other);
- Gemma 3: LLaVA's, and `token_type_ids` (1 at its images' tokens, read both ways);
- Gemma 4: its images' patches with their positions, `mm_token_type_ids`, and its clips'
  `input_features` [clips, frames, mel bins] with `input_features_mask`;
- Qwen2-Audio: `input_features` [clips, mel bins, the window] padded with zeros and its
  `feature_attention_mask`.

Pixels are our uint8 values normalised exactly as our encoder normalises them
(`config.spec.Inputs.table`), so both models see the same numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import Specials
from jaxmllm.hf.family import FamilyError


def normalised(cfg: Any, values: np.ndarray) -> np.ndarray:
    """uint8 pixels [..., K] (channels last, `cfg.model.vision.channels`) as our encoder
    takes them, float32; features as they are."""
    if values.dtype != np.uint8:
        return np.asarray(values, np.float32)
    table = BatchSpec.of(cfg).inputs["vision"].table()  # [C, 256]
    channel = np.arange(values.shape[-1]) % table.shape[0]
    return table[channel, values.astype(np.int64)]


def qwen_vl(sample: Sample, cfg: Any, specials: Specials) -> dict[str, np.ndarray]:
    """A Qwen VL's inputs (the module docstring)."""
    v = cfg.model.vision
    p, c, tp, m = v.patch_size, v.channels, v.temporal_patch, v.merge
    image, video = specials.media["vision"], specials.media["video"]
    tokens = np.asarray(sample.tokens)
    slots = np.flatnonzero(np.isin(tokens, [image, video]))
    out: dict[str, list] = {"image": [], "image_grid": [], "video": [], "video_grid": []}
    seconds = []
    item = slot = 0
    for grid in sample.grids:
        t, h, w = grid[:3]
        kind = "video" if tokens[slots[slot]] == video and video != image else "image"
        for k in range(t):
            values = normalised(cfg, sample.media["vision"][item + k][0])
            frames = values.shape[-1] // (p * p * c)
            x = values.reshape(-1, frames, p, p, c).transpose(0, 4, 1, 2, 3)
            out[kind].append(np.repeat(x, tp // frames, axis=2).reshape(len(values), -1))
        out[f"{kind}_grid"].append((t, h, w))
        if kind == "video" and len(grid) == 4:  # (Qwen2.5-VL: the seconds a temporal patch spans)
            seconds.append(grid[3] / v.tokens_per_second)
        item, slot = item + t, slot + t * h * w // m**2
    types = np.where(tokens == image, 1, 0) + np.where((tokens == video) & (video != image), 2, 0)
    inputs = {"input_ids": tokens.astype(np.int64), "mm_token_type_ids": types.astype(np.int64)}
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if out[kind]:
            inputs[key] = np.concatenate(out[kind]).astype(np.float32)
            inputs[f"{kind}_grid_thw"] = np.asarray(out[f"{kind}_grid"], np.int64)
    if seconds:
        inputs["second_per_grid_ts"] = np.asarray(seconds, np.float32)
    return inputs


def llava(sample: Sample, cfg: Any, specials: Specials) -> dict[str, np.ndarray]:
    """LLaVA's inputs: each image whole again, at its tower's size."""
    v = cfg.model.vision
    p, c, side = v.patch_size, v.channels, v.position_grid
    images = []
    for k, (values, positions) in enumerate(sample.media["vision"]):
        rows, cols = (positions.max(0) + 1).tolist()
        if (rows, cols) != (side, side):
            raise FamilyError(
                f"sample {sample.id}: image {k} is {rows}x{cols} patches; transformers' LLaVA "
                f"takes its tower's {side}x{side} only (data.image_min_pixels = "
                f"image_max_pixels = {(side * p) ** 2} and square images check it)"
            )
        image = np.zeros((rows * p, cols * p, c), np.float32)
        x = normalised(cfg, values).reshape(-1, p, p, c)
        for (r, q), patch in zip(positions.tolist(), x, strict=True):
            image[r * p : (r + 1) * p, q * p : (q + 1) * p] = patch
        images.append(image.transpose(2, 0, 1))
    inputs = {"input_ids": np.asarray(sample.tokens, np.int64)}
    if images:
        inputs["pixel_values"] = np.stack(images)
    return inputs


def gemma3(sample: Sample, cfg: Any, specials: Specials) -> dict[str, np.ndarray]:
    """Gemma 3's inputs: LLaVA's, and `token_type_ids` (1 at an image's tokens: they attend
    to each other both ways)."""
    inputs = llava(sample, cfg, specials)
    image = np.asarray(sample.tokens) == specials.media["vision"]
    inputs["token_type_ids"] = image.astype(np.int64)
    return inputs


def gemma4(sample: Sample, cfg: Any, specials: Specials) -> dict[str, np.ndarray]:
    """Gemma 4's inputs: `pixel_values` [images, patches, pixels] (each image's patches padded
    to the most any has) in [0, 1] such that its `2 (x - 0.5)` gives our normalised values,
    `image_position_ids` (column, row) of each patch (-1 for padding), `mm_token_type_ids` (1 at
    an image's tokens: read both ways in the sliding layers); its clips' (`gemma4_audio`)."""
    tokens = np.asarray(sample.tokens)
    image = tokens == specials.media["vision"]
    inputs = {"input_ids": tokens.astype(np.int64), "mm_token_type_ids": image.astype(np.int64)}
    items = sample.media["vision"]
    if items:
        most = max(len(values) for values, _ in items)
        width = np.asarray(items[0][0]).shape[-1]
        pixels = np.zeros((len(items), most, width), np.float32)
        where = np.full((len(items), most, 2), -1, np.int64)
        for k, (values, positions) in enumerate(items):
            pixels[k, : len(values)] = normalised(cfg, values) / 2 + 0.5
            where[k, : len(values)] = np.asarray(positions)[:, ::-1]
        inputs.update(pixel_values=pixels, image_position_ids=where)
    return {**inputs, **gemma4_audio(sample)}


def gemma4_audio(sample: Sample) -> dict[str, np.ndarray]:
    """Gemma 4's clips: `input_features` [clips, frames, mel bins], each clip's frames (those
    at a position >= 0: ours pad a clip to whole tokens at -1) padded with zeros to the most
    any has, and `input_features_mask` (true at a clip's own frames)."""
    items = sample.media.get("audio") or []
    if not items:
        return {}
    clips = [np.asarray(values, np.float32)[np.asarray(at) >= 0] for values, at in items]
    most = max(len(c) for c in clips)
    features = np.zeros((len(clips), most, clips[0].shape[-1]), np.float32)
    mask = np.zeros((len(clips), most), bool)
    for k, clip in enumerate(clips):
        features[k, : len(clip)] = clip
        mask[k, : len(clip)] = True
    return {"input_features": features, "input_features_mask": mask}


def qwen2_audio(sample: Sample, cfg: Any, specials: Specials) -> dict[str, np.ndarray]:
    """Qwen2-Audio's inputs: each clip (a chunk of one) in a window of its own, padded."""
    a = cfg.model.audio
    window = a.max_positions * a.stride
    clips = [np.asarray(values, np.float32) for values, _ in sample.media["audio"]]
    inputs = {"input_ids": np.asarray(sample.tokens, np.int64)}
    if clips:
        features = np.zeros((len(clips), a.n_mels, window), np.float32)
        mask = np.zeros((len(clips), window), np.int64)
        for k, clip in enumerate(clips):
            features[k, :, : len(clip)] = clip.T
            mask[k, : len(clip)] = 1
        inputs.update(input_features=features, feature_attention_mask=mask)
    return inputs


def text_only(sample: Sample, cfg: Any, specials: Specials) -> dict[str, np.ndarray]:
    """A causal LM's inputs."""
    return {"input_ids": np.asarray(sample.tokens, np.int64)}
