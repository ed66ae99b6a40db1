"""`python -m jaxmllm.hf check DIR`: our model from a HF directory against transformers itself.

Builds the module the checkpoint fills (`towers`), runs it and the transformers model on the
same random inputs in fp32, and reports the largest difference: of the logits for a decoder,
of the last hidden states for SigLIP and Whisper, of the patch merger's output for the Qwen VL
vision towers (and DeepStack's mergers' for Qwen3-VL's). Several inputs are packed into one
row the way training packs them (texts of three lengths, positions restarting at each; images
non-square and at resolutions other than the checkpoint's, SigLIP's table resized; clips), each
compared with transformers run on it alone. Needs torch and transformers (`pip install -e
'.[dev]'`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config import Config
from jaxmllm.data.media.image import patchify
from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.hf.registry import FAMILIES, family_for, read_hf_config, roles_of
from jaxmllm.hf.table import Reference
from jaxmllm.hf.towers import Towers, config_for, load_towers
from jaxmllm.hf.wholes import WHOLES

# (model_type, role) -> the transformers module compared, from each family's row; a whole
# checkpoint: its class (`check_whole` reads its parts)
HF_MODULES = {(t, f.role): f.row.reference(t) for f in FAMILIES for t in f.model_types}
HF_MODULES.update({(w.name, "llm"): Reference(w.name, w.hf_class) for w in WHOLES})


def role_of(hf: dict) -> str:
    """The role a checkpoint plays, from its model_type."""
    roles = roles_of(hf)
    if not roles:
        raise FamilyError(
            f"model_type {hf.get('model_type')!r} is not an architecture jaxmllm reads"
        )
    return roles[0]


def check_dir(
    directory: str, role: str = "", tokens: int = 64, seed: int = 0, packed: bool = True
) -> dict:
    """Compares our module with transformers' on random inputs, several packed into one row
    (`packed`; else each in a row of its own), each against transformers on it alone; returns
    the figures.

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
    what, ours, theirs = run(towers, reference, cfg, family, rng, tokens, packed)
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
    ref = HF_MODULES[hf["model_type"], role]
    cls = getattr(transformers, ref.cls, None)
    if cls is None:  # (a vision tower or audio encoder not exported at the top level)
        import importlib

        module = ref.module
        cls = getattr(
            importlib.import_module(f"transformers.models.{module}.modeling_{module}"), ref.cls
        )
    model = cls.from_pretrained(directory, dtype=torch.float32).eval()
    for part in filter(None, ref.path.split(".")):
        model = getattr(model, part)
    return model


def _torch(x: np.ndarray):
    """A numpy array as a torch tensor (contiguous: torch shares its memory)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x))


def _numpy(t) -> np.ndarray:
    """A torch tensor as an fp32 numpy array."""
    return t.detach().float().numpy()


def _llm(towers: Towers, ref, cfg: Config, family: Family, rng, tokens: int, packed: bool):
    """Three texts (tokens, 5/8 and 1/4 of it) packed into one row (segment ids 1, 2, 3,
    positions restarting at each), each against transformers on it alone."""
    import torch

    vocab = min(cfg.model.llm.vocab_size, ref.config.vocab_size)  # (the checkpoint's own ids)
    lengths = [tokens, max(2, tokens * 5 // 8), max(2, tokens // 4)]
    texts = [rng.integers(0, vocab, n) for n in lengths]
    with torch.no_grad():
        theirs = [_numpy(ref(input_ids=_torch(ids[None])).logits)[0] for ids in texts]
    rows = [np.concatenate(texts)] if packed else texts
    segments = [np.repeat(np.arange(1, len(lengths) + 1), lengths)] if packed else None
    ours = []
    for ids in rows:
        seg = segments[0] if packed else np.ones(len(ids), np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if packed else [0]
        positions = np.arange(len(ids)) - np.repeat(starts, lengths if packed else [len(ids)])
        if any(cfg.model.llm.mrope_section):  # text alone: time, row and column all count on
            positions = np.repeat(positions[..., None], 3, axis=-1)
        args = (jnp.asarray(ids)[None], jnp.asarray(seg)[None], jnp.asarray(positions)[None])
        ours.append(np.asarray(_decode(towers, *args))[0])
    ours = np.concatenate(ours)
    sizes = ", ".join(map(str, lengths))
    what = f"logits of {len(texts)} texts of {sizes} tokens {_where(packed)}"
    ours, what = own_columns(ours, np.concatenate(theirs), what)
    return what, ours, np.concatenate(theirs)


# One compiled program each (op by op, a tower compiles dozens of small ones).
_decode = nnx.jit(lambda t, ids, seg, pos: t.llm(t.llm.embed(ids), seg, pos, ids_bt=ids))
_encode_images = nnx.jit(lambda t, patches, seg, pos: t.vision(patches, seg, pos))
_encode_audio = nnx.jit(lambda t, frames, seg, pos: t.audio(frames, seg, pos))


def _images(cfg: Config, rng, grids: list[tuple[int, int]]) -> list[np.ndarray]:
    """Random images of `grids` patches, height by width."""
    p, c = cfg.model.vision.patch_size, cfg.model.vision.channels
    return [rng.normal(size=(h * p, w * p, c)).astype(np.float32) for h, w in grids]


def _rows(encode, towers, items: list[tuple], packed: bool) -> np.ndarray:
    """Our encoder's output of the items (inputs, positions), all packed into one row
    (segment ids 1, 2, ...) or each in a row of its own: [levels, rows of every item in
    order, width] (`encode`'s [levels, rows, width] of one row)."""
    groups = [items] if packed else [[x] for x in items]
    out = []
    for group in groups:
        x = np.concatenate([a for a, _ in group])[None]
        pos = np.concatenate([b for _, b in group])[None]
        seg = np.concatenate([np.full(len(a), k + 1) for k, (a, _) in enumerate(group)])[None]
        out.append(np.asarray(encode(towers, *map(jnp.asarray, (x, seg, pos)))))
    return np.concatenate(out, axis=1)


def _where(packed: bool) -> str:
    """How the figures' line says the inputs were laid out."""
    return "packed into 1 row" if packed else "each in a row of its own"


def _vision(towers: Towers, ref, cfg: Config, family: Family, rng, tokens: int, packed: bool):
    """A vision tower's figures: SigLIP's and CLIP's hidden states of non-square images off their
    table's grid, a Qwen VL tower's merger output (and DeepStack's) of several images, some cut by
    its windows."""
    import torch

    v = cfg.model.vision
    m = v.merge
    if v.positions == "learned":  # SigLIP, CLIP: non-square images off the table's grid
        g = v.position_grid
        tall, narrow = (g + m) // m * m, max(m, (g - m) // m * m)
        grids = [(tall, narrow), (narrow, tall)]
    else:  # (windows: an image of several, some cut by its edge)
        w = max(v.window, m)
        grids = [(2 * m, 3 * m), (m, 2 * m), (3 * m, m), (2 * w + m, w + m)]
    images = _images(cfg, rng, grids)
    items = [patchify(img, v.patch_size, m) for img in images]
    if v.positions == "learned":
        feats = _rows(_encode_images, towers, items, packed)[0]
        theirs = []
        with torch.no_grad():
            for image, (_, w), (_, pos) in zip(images, grids, items, strict=True):
                pixels = _torch(image.transpose(2, 0, 1)[None])
                out = ref(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
                raster = pos[:, 0] * w + pos[:, 1]  # ours are in merge order
                theirs.append(_numpy(out)[0, int(v.class_token) :][raster])  # (CLIP's first)
        what = f"hidden states of {len(grids)} images ({_sizes(grids)} patches) {_where(packed)}"
        return what, feats, np.concatenate(theirs)
    t, p, c = v.temporal_patch, v.patch_size, v.channels
    patches = np.concatenate([x for x, _ in items])
    frames = patches.reshape(-1, p, p, c).transpose(0, 3, 1, 2)[:, :, None]
    pixels = np.repeat(frames, t, axis=2).reshape(len(frames), -1)
    with torch.no_grad():  # (transformers' tower attends within each image: each alone)
        out = ref(hidden_states=_torch(pixels), grid_thw=torch.tensor([[1, *g] for g in grids]))
    theirs = _numpy(out.pooler_output)
    what = "merger output of"
    if v.deepstack:  # the merger's rows, then each DeepStack level's
        theirs = np.concatenate([theirs, *map(_numpy, out.deepstack_features)])
        what = f"merger and DeepStack ({len(v.deepstack)} levels) output of"
    ours = _rows(_encode_projected, towers, items, packed)
    ours = ours.reshape(-1, ours.shape[-1])
    what = f"{what} {len(grids)} images ({_sizes(grids)} patches) {_where(packed)}"
    return what, ours, theirs


def _sizes(grids) -> str:
    """Grids as "HxW" words."""
    return ", ".join(f"{h}x{w}" for h, w in grids)


@nnx.jit
def _encode_projected(t, x, seg, pos):
    """The projector's rows of one row's images [levels, rows, width]: the merger's, then each
    DeepStack level's (a tower with `deepstack`)."""
    if not t.vision.deepstack:
        return t.vision_projector(t.vision(x, seg, pos))
    feats, taps = t.vision.tapped(x, seg, pos)
    return jnp.concatenate([t.vision_projector(feats), t.vision_projector.deep(taps)[:, 0]])


def _audio(towers: Towers, ref, cfg: Config, family: Family, rng, tokens: int, packed: bool):
    """An audio encoder's figures: its hidden states of two clips of whole windows."""
    import torch

    a = cfg.model.audio
    if a.is_conformer:
        return _conformer(towers, ref, cfg, rng, packed)
    frames = a.max_positions * a.stride  # Whisper takes whole windows only
    clips = rng.normal(size=(2, frames, a.n_mels)).astype(np.float32)
    items = [(clip, np.arange(frames)) for clip in clips]
    ours = _rows(_encode_audio, towers, items, packed)[0]
    with torch.no_grad():  # (a batch of clips: each alone)
        theirs = _numpy(ref(_torch(clips.transpose(0, 2, 1))).last_hidden_state)
    theirs = theirs.reshape(-1, theirs.shape[-1])
    what = f"hidden states of 2 clips {_where(packed)}"
    return what, ours.reshape(len(theirs), -1), theirs


# Valid frames of the conformer's clips: none a multiple of 4 frames (their last LLM token's
# frames padded), 2 past one (where the second convolution reads a masked first one), and
# rows not a whole number of chunks for any chunk above 1
CONFORMER_CLIPS = (38, 53, 7, 90)


def _conformer(towers: Towers, ref, cfg: Config, rng, packed: bool):
    """Gemma 4's conformer's figures: its output rows of clips of several lengths (each padded
    to a whole LLM token, its padding frames at position -1 holding noise that must not
    count), against transformers on the clips batched with padding and their mask."""
    import torch

    a = cfg.model.audio
    items, theirs_in = [], np.zeros((len(CONFORMER_CLIPS), max(CONFORMER_CLIPS), a.n_mels))
    for k, v in enumerate(CONFORMER_CLIPS):
        padded = -(-v // a.subsample) * a.subsample
        clip = rng.normal(size=(padded, a.n_mels)).astype(np.float32)
        items.append((clip, np.where(np.arange(padded) < v, np.arange(padded), -1)))
        theirs_in[k, :v] = clip[:v]
    ours = _rows(_encode_audio, towers, items, packed)[0]
    mask = np.arange(theirs_in.shape[1])[None] < np.asarray(CONFORMER_CLIPS)[:, None]
    with torch.no_grad():
        out = ref(_torch(theirs_in.astype(np.float32)), attention_mask=_torch(mask))
    rows = [-(-v // a.subsample) for v in CONFORMER_CLIPS]
    theirs = np.concatenate([_numpy(out.last_hidden_state)[k, :n] for k, n in enumerate(rows)])
    counted = _numpy(out.attention_mask).sum(1).astype(int).tolist()
    if counted != rows:  # (the soft tokens a clip gets: ceil(frames / 4) both sides)
        raise FamilyError(f"transformers' rows per clip {counted}, ours {rows}")
    what = f"output rows of {len(rows)} clips ({', '.join(map(str, CONFORMER_CLIPS))} frames) "
    return what + _where(packed), ours, theirs


def describe(result: dict[str, Any]) -> str:
    """One line of figures for a person (a preference pair's: `check_pairs.describe_pair`)."""
    if "chosen_logps" in result:  # (a preference pair's line: `check_pairs`)
        from jaxmllm.hf.check_pairs import describe_pair

        return describe_pair(result)
    return (
        f"{result['family']} {result['role']}: {result['what']}: largest difference "
        f"{result['max_abs_diff']:.3g} (values up to {result['max_abs_ref']:.3g})"
    )
