"""`python -m jaxmllm.hf check DIR` on a whole checkpoint: the whole model against transformers.

Our model is the one `hf import --model DIR` configures, loaded on one device in fp32 with dense
attention (`towers.load_model`); transformers' is the checkpoint's own class. Lines, one each:

- the LLM on text alone (random ids, none a placeholder): its logits;
- the encoder and projector on the first sample's image or clip: the rows that fill its
  placeholders (transformers': a hook on its projector), and a tower with DeepStack its
  levels' rows (Qwen3-VL's `deepstack_features`);
- each of several samples (text alone, images of other sizes, a video of three temporal
  patches where the family reads videos, clips), PACKED INTO ONE ROW the way training packs
  them (`batch.prompts.packed_row`: bucketize itself, so segment ids, positions restarting per
  sample, M-RoPE's per sample, the encoder rows' slots and DeepStack's additions are
  training's): every token's logits of the sample against transformers run on that sample
  alone (`Whole.reference_inputs`). `packed=False` gives each sample a row of its own.

`data`: a data file of the user's own records (any data.format, its media beside it) instead of
random samples: its first records, preprocessed by the import's config (the checkpoint's
tokenizer and chat template, its processor's settings), are the samples. A causal LM alone
takes `data` too (its samples' text). Preference pairs (`chosen` and `rejected` records) are
compared as DPO uses them: each pair's completion log-prob sums, training's from the pairs
packed into one row against transformers' on each document alone (`check_pairs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.batch.prompts import packed_row
from jaxmllm.config import Config
from jaxmllm.config.phases import KINDS
from jaxmllm.data.media.image import patchify
from jaxmllm.data.media.video import temporal_patch, time_step
from jaxmllm.data.preprocess import Limits, Params, Preprocessor
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import Specials
from jaxmllm.hf import check_pairs, oracle
from jaxmllm.hf.check import (
    CONFORMER_CLIPS,
    _numpy,
    _torch,
    check_dir,
    figures,
    hf_module,
    own_columns,
)
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.registry import family_for, read_hf_config, roles_of
from jaxmllm.hf.towers import load_model
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.wholes import whole_for

# (the ids beside the embeddings: a decoder's per-layer inputs read them)
_logits = nnx.jit(
    lambda llm, x, pos, ids: llm(x, jnp.ones(x.shape[:2], jnp.int32), pos, ids_bt=ids)
)
_embed = nnx.jit(lambda llm, ids: llm.embed(ids))
_forward = nnx.jit(lambda m, mb: m(mb))
_encode = nnx.jit(lambda m, mb, name: m.encode_deep(mb, name), static_argnums=2)
# A clip's sampled frame rate in the video sample (not a whole number of temporal patches a
# second, so Qwen2.5-VL's absolute time rounds down between them)
VIDEO_FPS = 1.5
DATA_SAMPLES = 4  # `--data`: its first records (the readable ones)


def check_all(
    directory: str,
    role: str = "",
    tokens: int = 64,
    seed: int = 0,
    adapter: str = "",
    packed: bool = True,
    data: str = "",
) -> list[dict]:
    """`check_dir`'s figures for a checkpoint of one part; for a whole checkpoint,
    `check_whole`'s (only `role`'s line when one is named: llm, vision, audio or model).
    `adapter`: a PEFT LoRA adapter put on both models (ours by `hf import --adapter`,
    transformers' by peft's `PeftModel.from_pretrained`; a whole checkpoint's). `packed`:
    several samples in one row (else each in its own); `data`: the user's records instead of
    random samples (the module docstring)."""
    hf = read_hf_config(directory)
    whole = whole_for(hf)
    if adapter and whole is None and roles_of(hf) != ("llm",):
        raise FamilyError(
            f"--adapter: {directory} is an encoder alone; adapters are checked on a whole model "
            "(LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2-Audio) or a causal LM"
        )
    if data and whole is None and roles_of(hf) != ("llm",):
        raise FamilyError(
            f"--data: {directory} is an encoder alone; records are checked on a whole model or "
            "a causal LM"
        )
    if whole is None:
        if role == "model":
            raise FamilyError(
                f"{directory} holds one part, not a whole model: leave out --role "
                "model (or name the part: llm, vision, audio)"
            )
        if adapter:
            return [check_llm_adapter(directory, tokens, seed, adapter)]
        if data:
            return check_whole(directory, tokens, seed, packed=packed, data=data)
        return [check_dir(directory, role, tokens, seed, packed)]
    roles = [*whole.held(hf), "model"]
    if role and role not in roles:
        raise FamilyError(
            f"{directory} is a whole {whole.name} checkpoint with no {role} part: "
            f"--role is one of {', '.join(roles)}"
        )
    results = check_whole(directory, tokens, seed, adapter, packed, data)
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
    theirs = _run(ref, {"input_ids": ids})[0]
    ids_1t = jnp.asarray(ids)[None]
    ours = _logits(model.llm, _embed(model.llm, ids_1t), _positions(ids, False), ids_1t)
    ours, what = own_columns(ours[0], theirs, f"logits of {tokens} tokens with the adapter")
    family = family_for("llm", hf, directory)
    return figures("llm", family.name, what, ours, theirs)


def check_whole(
    directory: str,
    tokens: int = 64,
    seed: int = 0,
    adapter: str = "",
    packed: bool = True,
    data: str = "",
) -> list[dict]:
    """The figures of the module docstring, each {"role", "family", "what", "max_abs_diff",
    "max_abs_ref"} (`adapter`, `packed`, `data`: as `check_all`); a causal LM alone (`data`
    only) gets its samples' lines."""
    hf = read_hf_config(directory)
    whole = whole_for(hf)
    parts = whole.held(hf) if whole is not None else ("llm",)
    dirs = {r: directory if r in parts else "" for r in ("vision", "audio")}
    cfg, model = load_model(directory, dirs["vision"], dirs["audio"], adapter=adapter)
    cfg = _with_videos(cfg)
    ref = hf_module(directory, hf, "llm")
    if adapter:
        from peft import PeftModel

        ref = PeftModel.from_pretrained(ref, adapter).eval()
    name = whole.name if whole is not None else family_for("llm", hf, directory).name
    rng = np.random.default_rng(seed)
    pool, spare = text_pool(hf, min(cfg.model.llm.vocab_size, hf_vocab(hf)))
    text = lambda n: rng.choice(pool, n)
    out = []
    if not data:
        ids = text(tokens)
        theirs = _run(ref, {"input_ids": ids})[0]
        mrope = any(cfg.model.llm.mrope_section)
        x = _embed(model.llm, jnp.asarray(ids)[None])
        ours, what = own_columns(
            _logits(model.llm, x, _positions(ids, mrope), jnp.asarray(ids)[None])[0],
            theirs,
            f"logits of {tokens} text tokens",
        )
        out.append(figures("llm", name, what, ours, theirs))
        specials = check_specials(whole, hf, spare)
        samples = random_samples(cfg, whole, hf, rng, text)
    else:
        specials, records = data_records(cfg, data)
        samples = [(desc, sample) for _, desc, sample in records]
    reference = (
        (lambda s: whole.reference_inputs(s, cfg, specials))
        if whole is not None
        else (lambda s: oracle.text_only(s, cfg, specials))
    )
    if data and samples[0][1].is_pair:  # (a preference file: pairs only, `check_pairs`)
        ids = [rid for rid, _, _ in records]
        vocab = hf_vocab(hf)
        return out + pair_lines(
            cfg, model, ref, whole, name, samples, ids, specials, reference, packed, vocab
        )
    return out + sample_lines(cfg, model, ref, whole, name, samples, specials, reference, packed)


def pair_lines(cfg, model, ref, whole, name, samples, ids, specials, reference, packed, vocab):
    """The encoder's lines on the first pair with media (its chosen document against
    transformers'), and each pair's log-prob line (`check_pairs`): ours from one packed row
    (or a row each) as training computes them, transformers' from each document alone.
    `ids`: the pairs' record ids; `vocab`: the checkpoint's own columns."""
    first = next((k for k, (_, s) in enumerate(samples) if _media(s)), None)
    theirs, captured = [], {}
    for k, (_, sample) in enumerate(samples):
        sums = {}
        for side, doc in zip(check_pairs.SIDES, check_pairs.documents(sample), strict=True):
            taps = _taps(whole, doc, specials) if k == first and side == "chosen" else {}
            logits, got = _run(ref, reference(doc), taps)
            captured.update(got)
            total, count = check_pairs.document_logps(logits, doc)
            sums.update({side: total, f"{side}_tokens": count})
        theirs.append(sums)
    pairs = [s for _, s in samples]
    groups = [pairs] if packed else [[p] for p in pairs]
    mine = [m for g in groups for m in check_pairs.our_sums(cfg, model, g, specials, vocab)]
    out = []
    if first is not None:
        desc, sample = samples[first]
        chosen = check_pairs.documents(sample)[0]
        for phase in captured:
            out += encoder_lines(cfg, model, name, (desc, chosen), specials, captured, phase)
    n = len(samples)
    where = f"packed {n} pairs into 1 row" if packed else "each pair in a row of its own"
    grown = cfg.model.llm.vocab_size
    if vocab < grown:  # (`check.own_columns`)
        where += (
            f"; ours normalised over the checkpoint's {vocab} vocabulary columns (training's "
            f"over {grown}: the rows the import added for placeholder tokens too)"
        )
    for k, (desc, _) in enumerate(samples):
        out.append(check_pairs.pair_line(name, desc, ids[k], mine[k], theirs[k], k, n, where))
    return out


def sample_lines(cfg, model, ref, whole, name, samples, specials, reference, packed) -> list:
    """Each encoder's lines on the first sample with its media, and each sample's logits, ours
    from one packed row (or a row each) against transformers on the sample alone."""
    theirs, captured, firsts = [], {}, {}
    for k, (_, sample) in enumerate(samples):
        taps = {p: h for p, h in _taps(whole, sample, specials).items() if p not in firsts}
        logits, got = _run(ref, reference(sample), taps)
        theirs.append(logits)
        captured.update(got)
        firsts.update(dict.fromkeys(got, k))
    rows = [packed_row([s for _, s in samples], cfg, specials)] if packed else None
    rows = rows or [packed_row([s], cfg, specials) for _, s in samples]
    logits = [np.asarray(_forward(model, _device(mb)))[0, 0] for mb, _ in rows]
    out = []
    for phase, k in firsts.items():
        out += encoder_lines(cfg, model, name, samples[k], specials, captured, phase)
    n = len(samples)
    where = f"packed {n} samples into 1 row" if packed else "each sample in a row of its own"
    for k, ((desc, sample), mine) in enumerate(zip(samples, theirs, strict=True)):
        row, start = (0, rows[0][1][k]) if packed else (k, 0)
        ours = logits[row][start : start + len(sample.tokens)]
        what = f"logits of sample {k + 1} of {n} ({len(sample.tokens)} tokens: {desc}); {where}"
        ours, what = own_columns(ours, mine, what)
        out.append(figures("model", name, what, ours, mine))
    return out


def encoder_lines(cfg, model, name: str, sample_of, specials, captured, phase) -> list[dict]:
    """A sample's `phase` encoder rows (and DeepStack's levels) against transformers'
    (`captured[phase]`)."""
    desc, sample = sample_of
    mb, _ = packed_row([sample], cfg, specials)
    rows, deep = _encode(model, _device(mb), phase)
    n = int(np.isin(sample.tokens, specials.phase_ids(phase)).sum())
    theirs_rows, theirs_deep = captured[phase]
    out = [figures(phase, name, f"projected rows of {desc}", np.asarray(rows)[0, :n], theirs_rows)]
    if deep is not None:
        ours = np.asarray(deep)[:, 0, :n]
        what = f"DeepStack's rows of {desc} ({len(ours)} levels)"
        out.append(figures(phase, name, what, ours, theirs_deep))
    return out


def _taps(whole: Whole | None, sample: Sample, specials: Specials) -> dict:
    """The hooks (`table.WholeRow.hooks`) that read transformers' rows of a sample's media, per
    phase it holds, each with the count of its placeholders."""
    hooks = whole.row.hooks if whole is not None else {}
    return {
        p: (hook, int(np.isin(sample.tokens, specials.phase_ids(p)).sum()))
        for p, hook in hooks.items()
        if sample.media.get(p)
    }


def _media(sample: Sample) -> bool:
    """Whether a sample holds any media item."""
    return any(sample.media.values())


def _device(mb: dict) -> dict:
    """A micro-batch's arrays on the default device."""
    return jax.tree.map(jnp.asarray, mb)


def _with_videos(cfg: Config) -> Config:
    """`cfg` with its tower taking videos where it can (its buckets' patches a temporal patch
    wide; the parameters are the same)."""
    v = cfg.model.vision
    if not v.enabled or v.temporal_patch == 1 or v.video:
        return cfg
    model = dataclasses.replace(cfg.model, vision=dataclasses.replace(v, video=True))
    return dataclasses.replace(cfg, model=model)


def check_specials(whole: Whole | None, hf: dict, spare: np.ndarray) -> Specials:
    """The ids the packed row needs: the checkpoint's placeholders (config.json's), padding and
    the others from ids the random text never draws (`spare`)."""
    spare = [int(i) for i in spare]
    media = {}
    held = whole.held(hf) if whole is not None else ()
    if "vision" in held:
        media["vision"] = whole.token_id("vision", hf)
        media["video"] = hf.get("video_token_id", media["vision"])
    if "audio" in held:
        media["audio"] = whole.token_id("audio", hf)
    for kind in KINDS:
        media.setdefault(kind.name, spare.pop())
    if media["video"] is None:
        media["video"] = media["vision"]
    return Specials(pad=spare[0], bos=None, eos=spare[1], stop=(spare[1],), media=media)


def random_samples(cfg, whole: Whole | None, hf: dict, rng, text) -> list[tuple[str, Sample]]:
    """A family's samples of random ids and media, as its processor lays them out: text alone,
    images of two sizes (Qwen2.5-VL's several windows wide; LLaVA's at its tower's size), a
    video of three temporal patches where the family reads videos (Qwen3-VL's with text, its
    times, between them), clips."""
    if whole is None:
        return [(f"{n} text tokens", _text_sample(text(n))) for n in (24, 40, 16)]
    held = whole.held(hf)
    clips = _clips(cfg, whole, hf, rng, text) if "audio" in held else []
    if "vision" not in held:
        return [clips[0], ("text alone", _text_sample(text(24))), clips[1]]
    images = _images(cfg, whole, hf, rng, text)
    return images[:1] + clips[:1] + images[1:] + clips[1:]  # (the wholes with both: Gemma 4)


def _wrap(whole: Whole, hf: dict, phase: str) -> list[list[int]]:
    """The ids before and after a phase's item ([] where the row or config.json names none)."""
    keys = whole.row.wraps.get(phase, ("", ""))
    ids = [hf.get(k) for k in keys]
    return [[i] if i is not None and i < hf_vocab(hf) else [] for i in ids]


def _clips(cfg, whole: Whole, hf: dict, rng, text) -> list[tuple[str, Sample]]:
    """Two random clips between text: a quarter of the encoder's window short of it and half
    of it (Whisper's fixed windows), or the conformer's clips of 38 and 53 frames (neither a
    whole number of tokens)."""
    a = cfg.model.audio
    window = a.max_positions * a.stride
    lengths = [max(8, window * 3 // 4 // a.subsample * a.subsample), window // 2]
    if a.is_conformer:
        lengths = list(CONFORMER_CLIPS[:2])
    token, wrap = whole.token_id("audio", hf), _wrap(whole, hf, "audio")
    return [_clip_sample(n, a, token, wrap, rng, text) for n in lengths]


def _images(cfg, whole: Whole, hf: dict, rng, text) -> list[tuple[str, Sample]]:
    """Images of two sizes (and a video where the family reads videos) and text alone."""
    v = cfg.model.vision
    m = v.merge
    token = whole.token_id("vision", hf)
    wrap = _wrap(whole, hf, "vision")
    if whole.fixed_size:  # transformers reads LLaVA's, Gemma 3's images at the tower's size
        grids = [(v.position_grid, v.position_grid)] * 2
    else:
        w = max(v.window, m)
        grids = [(2 * w + m, w + m), (m, 2 * m)]
    image = lambda g, before, after: _image_sample(cfg, g, token, wrap, rng, text, before, after)
    out = [image(grids[0], 5, 7), ("text alone", _text_sample(text(24)))]
    video = hf.get("video_token_id")
    if not whole.fixed_size and v.temporal_patch > 1 and video is not None:
        out.append(_video_sample(cfg, whole, grids[0], int(video), wrap, rng, text))
    return [*out, image(grids[1], 3, 4)]


def _text_sample(ids: np.ndarray) -> Sample:
    """A sample of text alone (the ids given), no token trained."""
    ids = np.asarray(ids, np.int32)
    return Sample(0, ids, np.zeros(len(ids), bool))


def _image_sample(cfg, grid, token, wrap, rng, text, before: int, after: int):
    """A random image of `grid` patches between `before` and `after` text tokens, its placeholders
    as the tower's merged patches."""
    v = cfg.model.vision
    p, c, m = v.patch_size, v.channels, v.merge
    gh, gw = grid
    pixels = rng.integers(0, 256, (gh * p, gw * p, c), dtype=np.uint8)
    patches, positions = patchify(pixels, p, m)
    ids = [*text(before), *wrap[0], *[token] * (gh * gw // m**2), *wrap[1], *text(after)]
    ids = np.asarray(ids, np.int32)
    sample = Sample(0, ids, np.zeros(len(ids), bool), {"vision": [(patches, positions)]})
    sample.grids = [(1, gh, gw)]
    return f"a {gh}x{gw}-patch image", sample


def _video_sample(cfg, whole: Whole, grid, token: int, wrap, rng, text):
    """Three temporal patches of random frames sampled at VIDEO_FPS: one run of placeholders
    in its wrap (Qwen2-VL, Qwen2.5-VL: time in seconds x tokens_per_second), or each temporal
    patch after text standing for its time, in a wrap of its own (Qwen3-VL's)."""
    v = cfg.model.vision
    p, c, m, tp = v.patch_size, v.channels, v.merge, v.temporal_patch
    (gh, gw), t = grid, 3
    frames = rng.integers(0, 256, (t * tp, gh * p, gw * p, c), dtype=np.uint8)
    positions = patchify(np.zeros((gh * p, gw * p, 1), np.uint8), p, m)[1]
    items = [(temporal_patch(frames[k * tp : (k + 1) * tp], p, m), positions) for k in range(t)]
    n = gh * gw // m**2
    if whole.video_timestamps:
        ids = [*text(4)]
        for _ in range(t):
            ids += [*text(3), *wrap[0], *[token] * n, *wrap[1]]
        ids += [*text(5)]
        grids = [(1, gh, gw)] * t
    else:
        ids = [*text(5), *wrap[0], *[token] * (n * t), *wrap[1], *text(7)]
        step = (time_step(v.tokens_per_second, tp / VIDEO_FPS),) if v.tokens_per_second else ()
        grids = [(t, gh, gw, *step)]
    ids = np.asarray(ids, np.int32)
    sample = Sample(0, ids, np.zeros(len(ids), bool), {"vision": items})
    sample.grids = grids
    return f"a {t}-temporal-patch video ({gh}x{gw} patches)", sample


def _clip_sample(frames: int, a, token: int, wrap, rng, text):
    """A random clip of `frames` frames between text, in its `wrap`, a placeholder per LLM
    token: its frames padded to whole tokens, the padding frames (noise) at position -1, as
    `data.mel: gemma4` pads them."""
    tokens = -(-frames // a.subsample)
    padded = tokens * a.subsample
    clip = rng.normal(size=(padded, a.n_mels)).astype(np.float32)
    positions = np.where(np.arange(padded) < frames, np.arange(padded), -1).astype(np.int32)
    ids = np.asarray([*text(5), *wrap[0], *[token] * tokens, *wrap[1], *text(7)], np.int32)
    item = (clip, positions)
    return f"a {frames}-frame clip", Sample(0, ids, np.zeros(len(ids), bool), {"audio": [item]})


def data_records(cfg: Config, path: str) -> tuple[Specials, list[tuple[str, str, Sample]]]:
    """The first DATA_SAMPLES readable records of the data file at `path` (its media paths
    relative to its folder), preprocessed by `cfg` (the import's: the checkpoint's tokenizer,
    chat template and processor settings), each as (its record id, a description, the
    sample); the tokenizer's ids.

    Raises:
      FamilyError: no readable record there (naming the first record's problem).
    """
    pre = Preprocessor(Params.from_config(cfg))
    records = open_records(path, "auto", data=cfg.data)
    samples, problems = [], []
    for k in range(len(records)):
        try:
            record = read_record(records, k)
            sample = pre.sample(k, record, pre.sizes(record), Limits())
        except RecordError as e:
            problems.append(f"record {k}: {e}")
            continue
        items = {p: len(v) for p, v in sample.media.items() if v}
        what = ", ".join(f"{n} {p} item(s)" for p, n in items.items()) or "text alone"
        if sample.is_pair:
            what += ", a pair of {} and {} tokens".format(*sample.documents)
        samples.append((record.id, f"record {record.id!r}: {what}", sample))
        if len(samples) == DATA_SAMPLES:
            break
    if not samples:
        why = problems[0] if problems else "it holds no record"
        raise FamilyError(f"--data {path}: no record to check ({why})")
    return pre.tokenizer.specials, samples


def text_pool(hf: dict, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(the ids random text is drawn from, the spare ids `check_specials` makes a row's
    specials of): the first `vocab` ids less every id the checkpoint's config reserves (its
    `*token_id` / `*token_index`), the last few of them kept apart as the spares."""
    reserved = {hf.get(k) for k in hf if k.endswith(("token_id", "token_index"))} - {None}
    pool = np.setdiff1d(np.arange(vocab), list(reserved))
    return pool[: -len(KINDS) - 2], pool[-len(KINDS) - 2 :]


def hf_vocab(hf: dict) -> int:
    """The checkpoint's own vocabulary size (its text_config's where it nests one)."""
    return int((hf.get("text_config") or hf).get("vocab_size", 1 << 30))


def _positions(ids: np.ndarray, mrope: bool) -> jnp.ndarray:
    """Text positions of `ids`, the three M-RoPE axes alike where `mrope`."""
    positions = np.arange(len(ids))[None]
    return jnp.asarray(np.repeat(positions[..., None], 3, -1) if mrope else positions)


def _run(ref, inputs: dict[str, Any], taps: dict | None = None) -> tuple[np.ndarray, dict]:
    """transformers' logits [T, vocab] of one sample's inputs (numpy; batched here), and per
    phase of `taps` (phase -> (its hook, its placeholders n)) what the hook reads off its
    module: (its `n` rows, DeepStack's [K, rows, width] or None)."""
    import torch

    captured, handles = {}, []
    for phase, (hook, _) in (taps or {}).items():
        module = ref.get_base_model() if hasattr(ref, "get_base_model") else ref  # (peft's)
        for part in hook.module.split("."):
            module = getattr(module, part)
        keep = lambda mod, i, o, phase=phase: captured.update({phase: o})
        handles.append(module.register_forward_hook(keep))
    per_sample = (
        "input_ids",
        "mm_token_type_ids",
        "token_type_ids",
    )  # (the others are stacked items already)
    tensors = {
        k: _torch(v[None] if k in per_sample else v)
        for k, v in inputs.items()
        if isinstance(v, np.ndarray)
    }
    try:
        with torch.no_grad():
            logits = ref(**tensors).logits
    finally:
        for handle in handles:
            handle.remove()
    joined = lambda d: (
        np.concatenate([_numpy(x) for x in d]) if isinstance(d, list | tuple) else _numpy(d)
    )
    got = {}
    for phase, (hook, n) in (taps or {}).items():
        out = captured[phase]
        deep = getattr(out, "deepstack_features", None)
        deep = np.stack([joined(d) for d in deep]) if deep else None  # (split by image after)
        got[phase] = (_numpy(hook.rows(out, n)), deep)
    return _numpy(logits[0]), got
