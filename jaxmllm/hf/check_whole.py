"""`python -m jaxmllm.hf check DIR` on a whole checkpoint: the whole model against transformers.

Our model is the one `hf import --model DIR` configures, loaded on one device in fp32 with dense
attention (`towers.load_model`); transformers' is the checkpoint's own class. Both get the same
inputs, and three or four figures come back, one line each:

- the LLM on text alone (random ids, none a placeholder): its logits;
- the encoder and projector on one image (random pixels; LLaVA's at its tower's own size,
  which transformers requires; a Qwen VL's several windows wide) or one clip (random log-mel
  frames, three quarters of Whisper's window, the rest zero as the feature extractor pads):
  the rows that fill the placeholders (transformers': a hook on its projector);
- the whole model with the image or clip in the prompt (its placeholders, one per row, between
  text; M-RoPE's positions on the image's grid): the logits of every token;
- a Qwen VL's whole model with a video of three temporal patches in the prompt (its video
  placeholders; M-RoPE's time per temporal patch, in seconds x tokens_per_second for
  Qwen2.5-VL, as transformers' `second_per_grid_ts`): the logits of every token.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.batch.bucketize import mrope_positions
from jaxmllm.data.media.image import patchify
from jaxmllm.data.media.video import temporal_patch, time_step
from jaxmllm.hf.check import _numpy, _torch, check_dir, figures, hf_module, own_columns
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.registry import family_for, read_hf_config, roles_of
from jaxmllm.hf.towers import load_model
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.wholes import Llava, whole_for


def _merged(out, n):  # a Qwen VL tower's output: the merger's rows (split by image later)
    import torch

    rows = out.pooler_output
    return torch.cat(list(rows)) if isinstance(rows, list | tuple) else rows


HOOKS = {  # where transformers' rows come out: a module, and how to read its output
    "llava": ("model.multi_modal_projector", lambda out, n: out[0]),
    "qwen2_vl": ("model.visual", _merged),
    "qwen2_5_vl": ("model.visual", _merged),
    "qwen2_audio": ("model.multi_modal_projector", lambda out, n: out[0, :n]),
}
_logits = nnx.jit(lambda llm, x, pos: llm(x, jnp.ones(x.shape[:2], jnp.int32), pos))
_embed = nnx.jit(lambda llm, ids: llm.embed(ids))
_image = nnx.jit(lambda m, x, seg, pos: m.vision_projector(m.vision(x, seg, pos)))
_clip = nnx.jit(lambda m, x, seg, pos: m.audio_projector(m.audio(x, seg, pos)))


def check_all(
    directory: str, role: str = "", tokens: int = 64, seed: int = 0, adapter: str = ""
) -> list[dict]:
    """`check_dir`'s figures for a checkpoint of one part; for a whole checkpoint,
    `check_whole`'s (only `role`'s line when one is named: llm, vision, audio or model).
    `adapter`: a PEFT LoRA adapter put on both models (ours by `hf import --adapter`,
    transformers' by peft's `PeftModel.from_pretrained`; a whole checkpoint's)."""
    hf = read_hf_config(directory)
    whole = whole_for(hf)
    if adapter and whole is None and roles_of(hf) != ("llm",):
        raise FamilyError(
            f"--adapter: {directory} is an encoder alone; adapters are checked on a whole model "
            "(LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen2-Audio) or a causal LM"
        )
    if whole is None:
        if role == "model":
            raise FamilyError(
                f"{directory} holds one part, not a whole model: leave out --role "
                "model (or name the part: llm, vision, audio)"
            )
        if adapter:
            return [check_llm_adapter(directory, tokens, seed, adapter)]
        return [check_dir(directory, role, tokens, seed)]
    roles = [*whole.parts, "model"]
    if role and role not in roles:
        raise FamilyError(
            f"{directory} is a whole {whole.name} checkpoint with no {role} part: "
            f"--role is one of {', '.join(roles)}"
        )
    results = check_whole(directory, tokens, seed, adapter)
    return [r for r in results if r["role"] == role] if role else results


def check_llm_adapter(directory: str, tokens: int, seed: int, adapter: str) -> dict:
    """A causal LM with a PEFT adapter: our logits (the adapter read as `hf import --adapter`
    reads it) against transformers' under peft's `PeftModel.from_pretrained`."""
    from peft import PeftModel

    hf = read_hf_config(directory)
    cfg, model = load_model(directory, adapter=adapter)
    ref = PeftModel.from_pretrained(hf_module(directory, hf, "llm"), adapter).eval()
    ids = np.random.default_rng(seed).integers(
        0, min(cfg.model.llm.vocab_size, hf_vocab(hf)), tokens
    )
    theirs = _run(ref, ids)[0]
    ours = _logits(model.llm, _embed(model.llm, jnp.asarray(ids)[None]), _positions(ids, False))
    ours, what = own_columns(ours[0], theirs, f"logits of {tokens} tokens with the adapter")
    family = family_for("llm", hf, directory)
    return figures("llm", family.name, what, ours, theirs)


def check_whole(directory: str, tokens: int = 64, seed: int = 0, adapter: str = "") -> list[dict]:
    """The figures of the module docstring, each {"role", "family", "what", "max_abs_diff",
    "max_abs_ref"}; the last one the whole model's (`adapter`: as `check_all`)."""
    hf = read_hf_config(directory)
    whole = whole_for(hf)
    assert whole is not None, directory
    dirs = {r: directory if r in whole.parts else "" for r in ("vision", "audio")}
    cfg, model = load_model(directory, dirs["vision"], dirs["audio"], adapter=adapter)
    ref = hf_module(directory, hf, "llm")
    if adapter:
        from peft import PeftModel

        ref = PeftModel.from_pretrained(ref, adapter).eval()
    rng = np.random.default_rng(seed)
    vocab = cfg.model.llm.vocab_size
    reserved = {hf.get(k) for k in hf if k.endswith(("token_id", "token_index"))}
    allowed = np.setdiff1d(np.arange(min(vocab, hf_vocab(hf))), list(reserved - {None}))
    text = lambda n: rng.choice(allowed, n)
    mrope = any(cfg.model.llm.mrope_section)
    out = []

    ids = text(tokens)
    theirs = _run(ref, ids)[0]
    ours = _logits(model.llm, _embed(model.llm, jnp.asarray(ids)[None]), _positions(ids, mrope))
    ours, what = own_columns(ours[0], theirs, f"logits of {tokens} text tokens")
    out.append(figures("llm", whole.name, what, ours, theirs))

    media = "vision" if "vision" in whole.parts else "audio"
    prompt = (_image_prompt if media == "vision" else _clip_prompt)(cfg, model, whole, hf, rng)
    what, rows, inputs, token, positions, n = prompt
    before, after = inputs.pop("around")
    ids = np.concatenate([text(5), before, [token] * n, after, text(7)]).astype(np.int64)
    if "image_grid_thw" in inputs:  # (transformers 5 finds a Qwen VL's image tokens by these)
        inputs["mm_token_type_ids"] = _torch((ids == token)[None].astype(np.int64))
    if mrope:
        positions = mrope_positions(ids, token, positions, cfg.model.vision.merge)[None]
    else:
        positions = np.arange(len(ids))[None]
    theirs, captured = _run(ref, ids, HOOKS[whole.name], n, **inputs)
    out.append(figures(media, whole.name, f"projected rows of {what}", rows[0], captured))
    x = _embed(model.llm, jnp.asarray(ids)[None])
    x = x.at[0, np.flatnonzero(ids == token)].set(rows[0].astype(x.dtype))
    ours = _logits(model.llm, x, jnp.asarray(positions))
    ours, what = own_columns(
        ours[0], theirs, f"logits of {len(ids)} tokens with {what} in the prompt"
    )
    out.append(figures("model", whole.name, what, ours, theirs))
    video = hf.get("video_token_id")
    if mrope and cfg.model.vision.temporal_patch > 1 and video is not None and video < vocab:
        out.append(_video_check(cfg, model, ref, whole, int(video), text, rng))
    return out


# A clip's sampled frame rate in the video line (not a whole number of temporal patches a
# second, so Qwen2.5-VL's absolute time rounds down between them)
VIDEO_FPS = 1.5


def _video_check(cfg, model, ref, whole: Whole, token: int, text, rng) -> dict:
    """The whole model with a video of three temporal patches in the prompt (random frames
    sampled at VIDEO_FPS): every token's logits, M-RoPE's time on the temporal patches (in
    absolute time where the model counts tokens_per_second: Qwen2.5-VL's second_per_grid_ts)."""
    import torch

    v = cfg.model.vision
    m, p, c, tp = v.merge, v.patch_size, v.channels, v.temporal_patch
    w = max(v.window, m)
    gh, gw, t = 2 * w + m, w + m, 3
    frames = rng.normal(size=(t * tp, gh * p, gw * p, c)).astype(np.float32)
    items = [temporal_patch(frames[k * tp : (k + 1) * tp], p, m) for k in range(t)]
    positions = patchify(np.zeros((gh * p, gw * p, 1), np.float32), p, m)[1]
    patches = np.concatenate(items)
    segments = np.repeat(np.arange(1, t + 1), len(positions))[None]
    rows = np.asarray(
        _image(
            model,
            jnp.asarray(patches)[None],
            jnp.asarray(segments, jnp.int32),
            jnp.asarray(np.tile(positions, (t, 1)))[None],
        )
    )
    ids = np.concatenate([text(5), [token] * (len(patches) // m**2), text(7)]).astype(np.int64)
    grid = (t, gh, gw)
    inputs = {
        "video_grid_thw": torch.tensor([grid]),
        "mm_token_type_ids": _torch(2 * (ids == token)[None].astype(np.int64)),
    }
    if v.tokens_per_second:  # (Qwen2.5-VL: the seconds a temporal patch spans)
        inputs["second_per_grid_ts"] = torch.tensor([tp / VIDEO_FPS])
        grid = (*grid, time_step(v.tokens_per_second, tp / VIDEO_FPS))
    theirs_pixels = patches.reshape(-1, tp, p, p, c).transpose(0, 4, 1, 2, 3)
    inputs["pixel_values_videos"] = _torch(theirs_pixels.reshape(len(patches), -1))
    theirs, _ = _run(ref, ids, **inputs)
    x = _embed(model.llm, jnp.asarray(ids)[None])
    x = x.at[0, np.flatnonzero(ids == token)].set(rows[0].astype(x.dtype))
    pos = mrope_positions(ids, token, [grid], m)[None]
    ours = _logits(model.llm, x, jnp.asarray(pos))
    what = f"a {t}-temporal-patch video ({gh}x{gw} patches) in the prompt"
    ours, what = own_columns(ours[0], theirs, f"logits of {len(ids)} tokens with {what}")
    return figures("model", whole.name, what, ours, theirs)


def hf_vocab(hf: dict) -> int:
    return int((hf.get("text_config") or hf).get("vocab_size", 1 << 30))


def _positions(ids: np.ndarray, mrope: bool) -> jnp.ndarray:
    positions = np.arange(len(ids))[None]
    return jnp.asarray(np.repeat(positions[..., None], 3, -1) if mrope else positions)


def _image_prompt(cfg, model, whole: Whole, hf: dict, rng):
    import torch

    v = cfg.model.vision
    m, p, c = v.merge, v.patch_size, v.channels
    if isinstance(whole, Llava):  # transformers reads LLaVA's images at the tower's size
        gh = gw = v.position_grid
    else:
        w = max(v.window, m)
        gh, gw = 2 * w + m, w + m
    image = rng.normal(size=(gh * p, gw * p, c)).astype(np.float32)
    patches, positions = patchify(image, p, m)
    segments = jnp.ones((1, len(patches)), jnp.int32)
    rows = np.asarray(
        _image(model, jnp.asarray(patches)[None], segments, jnp.asarray(positions)[None])
    )
    token, n = whole.token_id("vision", hf), gh * gw // m**2
    if isinstance(whole, Llava):
        inputs: dict[str, Any] = {"pixel_values": _torch(image.transpose(2, 0, 1)[None])}
        inputs["around"] = ([], [])
    else:
        frames = patches.reshape(-1, p, p, c).transpose(0, 3, 1, 2)[:, :, None]
        pixels = np.repeat(frames, v.temporal_patch, axis=2).reshape(len(frames), -1)
        inputs = {"pixel_values": _torch(pixels), "image_grid_thw": torch.tensor([[1, gh, gw]])}
        wrap = [hf.get(k) for k in ("vision_start_token_id", "vision_end_token_id")]
        wrap = [[i] if i is not None and i < hf_vocab(hf) else [] for i in wrap]
        inputs["around"] = tuple(wrap)
    return f"a {gh}x{gw}-patch image", rows, inputs, token, [(gh, gw)], n


def _clip_prompt(cfg, model, whole: Whole, hf: dict, rng):
    import torch

    a = cfg.model.audio
    window = a.max_positions * a.stride  # transformers takes Whisper's whole window
    frames = max(8, window * 3 // 4 // a.subsample * a.subsample)
    clip = rng.normal(size=(frames, a.n_mels)).astype(np.float32)
    rows = np.asarray(
        _clip(
            model,
            jnp.asarray(clip)[None],
            jnp.ones((1, frames), jnp.int32),
            jnp.arange(frames)[None],
        )
    )
    features = np.zeros((1, a.n_mels, window), np.float32)
    features[0, :, :frames] = clip.T
    mask = (np.arange(window) < frames)[None].astype(np.int64)
    inputs = {
        "input_features": _torch(features),
        "feature_attention_mask": torch.from_numpy(mask),
        "around": ([], []),
    }
    token = whole.token_id("audio", hf)
    return f"a {frames}-frame clip", rows, inputs, token, None, frames // a.subsample


def _run(ref, ids: np.ndarray, hook=None, n: int = 0, **inputs):
    """transformers' logits [T, vocab] of `ids` (and what `hook` reads off its module)."""
    import torch

    captured = {}
    handle = None
    if hook is not None:
        module = ref.get_base_model() if hasattr(ref, "get_base_model") else ref  # (peft's)
        for part in hook[0].split("."):
            module = getattr(module, part)
        handle = module.register_forward_hook(lambda mod, i, o: captured.update(out=o))
    try:
        with torch.no_grad():
            logits = ref(input_ids=torch.from_numpy(ids[None].astype(np.int64)), **inputs).logits
    finally:
        if handle is not None:
            handle.remove()
    theirs = _numpy(logits[0])
    if hook is None:
        return theirs, None
    return theirs, _numpy(hook[1](captured["out"], n))
