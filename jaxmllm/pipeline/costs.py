"""What each piece of the model costs per microbatch on one device bucket, as the partitioner
sees it: per transformer layer, and at the ends of each stack (embeddings, projectors, head).

Pure Python over the config. Under fixed shapes a device computes its whole bucket, so a cost is
a function of the capacities (`batch.*`), not of the samples: per layer the matrices' FLOPs of
every token, patch or audio row the bucket holds (`cost.flops.layer_linear`), plus attention:
4 * pairs * width for the pairs computed (dense: every pair of each row; block-sparse: the
tile capacity's tiles of block x block pairs; cuDNN: the causal half of each LLM row).

Training multiplies a forward by `cost.training.multiplier`: 3 trainable, 2 frozen with something
trainable below it or LoRA adapters inside (input gradients only), 1 frozen with nothing
trainable below (no backward at all). Here that is the backward's share: 2, 1 or 0 times the
forward; a module's adapters add their own forward and twice it back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxmllm.config.phases import BY_NAME, LLM, NAMES
from jaxmllm.cost import training
from jaxmllm.cost.flops import layer_linear

# The encoders' chain order in front of the LLM when run as pipeline stages: the table's, last
# first (the last encoder phase starts the chain)
ENCODERS = tuple(reversed(NAMES))


@dataclasses.dataclass(frozen=True)
class Work:
    """Forward and backward cost of one piece of work (FLOPs, or seconds once measured)."""

    fwd: float = 0.0
    bwd: float = 0.0

    @property
    def total(self) -> float:
        """Forward plus backward: the whole work."""
        return self.fwd + self.bwd

    def __add__(self, other: Work) -> Work:
        """The two pieces' work together, forward and backward each summed."""
        return Work(self.fwd + other.fwd, self.bwd + other.bwd)

    def times(self, k: float) -> Work:
        """This work done `k` times (a layer's over the segment's layers, a pass's over
        microbatches)."""
        return Work(self.fwd * k, self.bwd * k)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A transformer stack as the pipeline sees it: identical layers and work at both ends."""

    name: str  # an encoder phase's name, or llm
    layers: int
    layer: Work  # one layer over one microbatch's bucket
    enter: Work  # before the first layer: patch embedding, convolutions, token embedding
    leave: Work  # after the last: final norm + projector (encoders), final norm + head + loss

    def whole(self) -> Work:
        """The whole stack's work over one microbatch: entering, every layer, leaving."""
        return self.enter + self.layer.times(self.layers) + self.leave


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """The stacks of a model in chain order (enabled encoders, then the LLM) and the step's
    microbatches."""

    microbatches: int
    segments: tuple[Segment, ...]

    def segment(self, name: str) -> Segment:
        """The segment of this name (an encoder phase or llm); StopIteration when the model has
        none."""
        return next(s for s in self.segments if s.name == name)

    @property
    def encoders(self) -> tuple[str, ...]:
        """The names of the encoder segments, in chain order (the LLM left out)."""
        return tuple(s.name for s in self.segments if s.name != LLM)


def model_costs(model: Any, batch: Any, fractions: dict[str, float] | None = None) -> ModelCosts:
    """Per-microbatch costs of a (resolved) model and batch config.

    Args:
      model: `ModelConfig` (or anything with its attributes).
      batch: `BatchConfig`; a tile capacity still -1 (auto) counts as a whole row's pairs.
      fractions: per encoder, the share of its bucket a step variant runs (default 1; 0: the
        encoder is skipped: no work).
    """
    fractions = fractions or {}
    on = [BY_NAME[name] for name in ENCODERS if BY_NAME[name].enabled(model)]
    how = training.modules(model)  # (what trains: frozen, adapters, the multipliers)
    segments = []
    for p in on:
        if fractions.get(p.name, 1.0) > 0:
            cost = SEGMENTS[p.name]
            segments.append(cost(model, batch, fractions.get(p.name, 1.0), how))
    segments.append(_llm(model, batch, how))
    return ModelCosts(batch.microbatches, tuple(segments))


def _back(module: training.Module) -> float:
    """Backward over forward of a module's base (`training.multiplier` - 1)."""
    return module.multiplier - 1


def _adapters(module: training.Module, shapes: dict, units: float) -> Work:
    """The work of a module's LoRA adapters over `units` tokens: their forward, twice it
    back (their weights' and their input's gradients)."""
    fwd = training.adapter_flops(module, shapes) * units
    return Work(fwd, 2 * fwd)


def _work(fwd: float, back: float) -> Work:
    """The work of a module's base: `fwd` FLOPs forward and `back` times that backward (`_back`)."""
    return Work(fwd, fwd * back)


def _attention(model: Any, rows: int, length: int, tiles: int, block: int, causal: bool) -> float:
    """Query-key pairs one layer scores over a device's bucket (see the module docstring)."""
    kind = model.attention
    if kind == "block_sparse" and tiles >= 0:
        return float(tiles * block * block)
    if kind == "cudnn" and causal:
        return rows * length * (length + 1) / 2
    return float(rows * length * length)


def _llm(model: Any, batch: Any, how: dict) -> Segment:
    """The LLM as a pipeline segment over one microbatch's bucket: per layer its matmuls and
    attention pairs (block-sparse: a device's rows as one row), the token embedding free, the
    head's logits and loss leaving; backward per how each module trains (frozen, LoRA, full)."""
    lm, back = model.llm, _back(how[LLM])
    tokens = batch.llm_rows * batch.llm_row_len
    head = lm.head_dim or lm.width // lm.heads
    q, kv = head * lm.heads, head * lm.kv_heads  # query (and output) width, key/value width
    sparse = model.attention == "block_sparse"  # (a device's rows attend as one row)
    rows, length = (1, tokens) if sparse else (batch.llm_rows, batch.llm_row_len)
    pairs = _attention(model, rows, length, batch.llm_tiles, batch.attention_block, True)
    layer = layer_linear(lm.width, kv, lm.mlp_dim, q, lm.mlp) * tokens + 4.0 * pairs * q
    logits = 2.0 * lm.width * lm.vocab_size * tokens
    adapters = _adapters(how[LLM], training.block_shapes(lm.width, kv, lm.mlp_dim, q), tokens)
    return Segment(LLM, lm.depth, _work(layer, back) + adapters, Work(), _work(logits, back))


def _vision(model: Any, batch: Any, fraction: float, how: dict) -> Segment:
    """The vision tower as a segment over `fraction` of its patch bucket: the patch embedding
    entering, per layer its matmuls and attention pairs, the projector (merge groups to LLM
    width) leaving, each with its LoRA adapters where it has them."""
    v, lm = model.vision, model.llm
    patches = _scaled(batch.vision_patches, fraction)
    tiles = variant_tiles(batch.vision_tiles, patches, batch.attention_block)
    pairs = _attention(model, 1, patches, tiles, batch.attention_block, False)
    layer = layer_linear(v.width, v.width, v.mlp_dim, mlp=v.mlp) * patches
    layer += 4.0 * pairs * v.width
    embed = 2.0 * v.patch_size**2 * v.channels * v.width * patches
    area, hidden = v.merge**2, v.projector_dim or lm.width
    project = 2.0 * (area * v.width * hidden + hidden * lm.width) * patches / area
    if v.projector == "pool":  # (one Linear from the pooled row)
        project = 2.0 * v.width * lm.width * patches / area
    own, proj = how["vision"], how["vision_projector"]
    layer = _work(layer, _back(own))
    layer += _adapters(own, training.block_shapes(v.width, v.width, v.mlp_dim), patches)
    shapes = {"fc1": (area * v.width, hidden), "fc2": (hidden, lm.width), "fc": (v.width, lm.width)}
    leave = _work(project, _back(proj)) + _adapters(proj, shapes, patches / area)
    return Segment("vision", v.depth, layer, _work(embed, _back(own)), leave)


def _audio(model: Any, batch: Any, fraction: float, how: dict) -> Segment:
    """The audio encoder as a segment over `fraction` of its frame bucket: the stem's
    convolutions entering (Whisper's or the strided one), per layer its matmuls and attention
    over the encoder rows, the projector to LLM width leaving."""
    a, lm = model.audio, model.llm
    frames = _scaled(batch.audio_frames, fraction)
    rows = frames // a.stride  # encoder rows (the stem's stride)
    tiles = variant_tiles(batch.audio_tiles, rows, batch.attention_block)
    pairs = _attention(model, 1, rows, tiles, batch.attention_block, False)
    layer = layer_linear(a.width, a.width, a.mlp_dim, mlp=a.mlp) * rows + 4.0 * pairs * a.width
    if a.stem == "whisper":  # kernel-3 convolutions, stride 1 then 2
        convs = 2.0 * 3 * a.width * (a.n_mels + a.width / 2) * frames
    else:  # two kernel-2 stride-2: 2 * n_mels -> width over frames / 2, 2 * width -> width
        convs = 2.0 * 2 * a.n_mels * a.width * frames / 2 + 2.0 * 2 * a.width * a.width * rows
    hidden, merged = a.projector_dim or lm.width, a.subsample // a.stride  # rows per LLM token
    project = 2.0 * (merged * a.width * hidden + hidden * lm.width) * frames / a.subsample
    own, proj = how["audio"], how["audio_projector"]
    layer = _work(layer, _back(own))
    layer += _adapters(own, training.block_shapes(a.width, a.width, a.mlp_dim), rows)
    shapes = {
        "fc1": (merged * a.width, hidden),
        "fc2": (hidden, lm.width),
        "fc": (a.width, lm.width),
    }
    leave = _work(project, _back(proj)) + _adapters(proj, shapes, frames / a.subsample)
    return Segment("audio", a.depth, layer, _work(convs, _back(own)), leave)


# Per encoder phase of the table: its stack's costs from its config section
SEGMENTS = {"vision": _vision, "audio": _audio}


def _scaled(capacity: int, fraction: float) -> int:
    """A bucket's capacity cut to `fraction` of it (rounded), as a step variant runs it."""
    return int(round(capacity * fraction))


def variant_tiles(tiles: int, units: int, block: int) -> int:
    """The tile capacity of an encoder bucket cut to `units` (patches, audio rows): no more
    than its blocks can pair, nor than the whole bucket's capacity (-1: unresolved, as is)."""
    return tiles if tiles < 0 else min(tiles, math.ceil(units / block) ** 2)
