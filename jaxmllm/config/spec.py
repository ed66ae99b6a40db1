"""The resolved batch: every size the step's arrays are shaped by, with no `auto` or -1 left.

`batch.capacity: auto` and the -1 sizes of `BatchConfig` are resolved against the data once, at
start-up (`jaxmllm.resolve.sizing.resolve_batch`, dry runs of the planner included); the resolved
config is kept with the checkpoints. What shapes arrays (the model, bucketize, the feed) takes a
`BatchSpec` of it, which refuses a config that still has a sentinel, naming the key, so no shape
is ever made from one; the planner's capacities and the limits on one sample are derived from
the same spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from jaxmllm.config.checks import ConfigError
from jaxmllm.config.phases import ENCODERS, LLM, enabled, in_batch

RESOLVE = (
    "resolve it against the data first (jaxmllm.resolve.sizing.resolve_batch; the trainer does)"
)


@dataclass(frozen=True)
class Inputs:
    """How an encoder phase's inputs travel to the devices and what its encoder makes of them.

    `uint8`: pixel values, channels last (`Phase.pixels`; `len(mean)` channels); the encoder
    maps each through `table()`, (x / 255 - mean) / std per channel in float32 by the
    arithmetic the host used when it normalised pixels itself (bit for bit), and padding
    (segment 0) to 0. Otherwise the inputs are their values, of `dtype`: features (log-mel
    frames) travel in the model's compute dtype where it is bfloat16, half float32's bytes and
    the same values, since the encoder's first layer casts its inputs to it anyway (the host's
    cast and XLA's both round to nearest even).
    """

    dtype: str = "float32"  # uint8 (pixels) | float32 | bfloat16 (features, bf16 compute)
    mean: tuple[float, ...] = ()  # data.image_mean (pixels)
    std: tuple[float, ...] = ()  # data.image_std

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16 if self.dtype == "bfloat16" else self.dtype)

    @classmethod
    def pixels(cls, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> Inputs:
        return cls("uint8", tuple(float(v) for v in mean), tuple(float(v) for v in std))

    def table(self) -> np.ndarray:
        """Each channel's normalised value of each uint8 pixel value, float32 [C, 256]."""
        x = np.broadcast_to(np.arange(256, dtype=np.float32), (len(self.mean), 256)).copy()
        if self.mean == self.std == (0.5,) * len(self.mean):
            x /= 127.5  # (what the host computed when it normalised: the same bits)
            x -= 1.0
        else:
            x /= 255.0
            x -= np.asarray(self.mean, np.float32)[:, None]
            x /= np.asarray(self.std, np.float32)[:, None]
        return x

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        """Host-side, what the encoder computes of uint8 pixels [..., K * C] (no padding)."""
        channels = np.arange(pixels.shape[-1]) % len(self.mean)
        return self.table()[channels, pixels]


@dataclass(frozen=True)
class BatchSpec:
    """Per device and microbatch, the sizes of a step's buckets: the one spec of what fits a
    bucket, from which every layer takes its limits. The planner's capacities are derived from
    it (`jaxmllm.plan.contract.Capacities.of`), so are the data layer's limits on one sample
    (`jaxmllm.data.oversize.sample_limits`: a context group's row of LLM tokens, each encoder
    bucket of a fixed size) and the arrays bucketize fills and the model takes.

    `of(cfg)` refuses a config with a size still -1 or auto (naming the key), except the tile
    capacities: a model can be built without them, a batch cannot (`tile_caps` refuses);
    `of(cfg, resolved=False)` is the spec of a config the data has not sized yet (start-up:
    the limits on a sample, the dry runs that size the rest), its sentinels in `unresolved`.
    """

    microbatches: int
    llm_rows: int
    llm_row_len: int  # tokens of a device's LLM row (a context group's: `group_row_len`)
    units: Mapping[str, int]  # per encoder phase a step runs (`phases.in_batch`): its bucket
    route_pair_capacity: int  # encoder rows one device may send another (0: local)
    exchange: str  # dense | ragged
    attention_block: int  # block-sparse attention's tile side (every encoder takes it)
    # Per phase (the LLM's and each encoder's the step runs): tiles a bucket computes, those
    # resolved (block-sparse attention only, else empty: read them with `tile_caps`); most
    # documents a row holds (cuDNN; a tower's class tokens, one row each, when resolved:
    # `bounded`)
    tiles: Mapping[str, int]
    documents: Mapping[str, int]
    # Block-sparse attention's long step variants (`jaxmllm.plan.ladder`): per variant 1, 2,
    # ... and phase, its tiles (0: the variant below's); read them with `tile_caps(variant)`
    long_tiles: tuple[Mapping[str, int], ...] = ()
    # The batch keys (and `model.attention`) still -1 or auto: only tile keys in a spec of
    # `of(cfg)`, any in one of `of(cfg, resolved=False)`
    unresolved: tuple[str, ...] = ()
    # Per phase a step runs: how its inputs travel (uint8 pixels, normalised on the device)
    inputs: Mapping[str, Inputs] = field(default_factory=dict)
    # mesh.context: an LLM bucket is a group of this many devices, whose rows are this many
    # devices' rows long (the encoders keep a bucket per device)
    context: int = 1
    # A context degree per step (mesh.context_steps: long): the long variants' LLM buckets are
    # groups of this many devices, the base variant's those of `context` (1); 0 = every
    # variant's those of `context`. A view of one variant is `at(variant)`
    long_context: int = 0
    # mesh.context_strategy: how the group's ranks attend (gather | ulysses), which the model
    # is built for (`jaxmllm.models.context`)
    context_strategy: str = "gather"
    attention: str = "block_sparse"  # model.attention, resolved: the kernel
    devices_per_host: int = 0  # data-parallel positions per host (0: all on one)
    # Per encoder phase of the table (the model's or not): its units per LLM token (patches
    # per merged token, frames per token) and per encoder row (what its attention sees)
    per_token: Mapping[str, int] = field(default_factory=dict)
    per_row: Mapping[str, int] = field(default_factory=dict)
    # Per encoder phase the model has, the most units one sample may use: its bucket where
    # batch.capacity is fixed; none under auto (the buckets are sized to hold the data's
    # largest item)
    sample_units: Mapping[str, int] = field(default_factory=dict)
    # Preference pairs (train.objective: dpo): a bucket's tokens say which pair and side they
    # are (`llm_sequence`), and a pair's media rows fill both its documents' slots
    pairs: bool = False
    # ... with their reference log-probs given (preference.reference: precomputed): each
    # document's on its first token (`llm_reference`)
    pair_reference: bool = False
    # The most documents of one sample that share its media (encoded once, each item's rows
    # filling its slots in every document, `models.mllm.fill_slots`): 2 for preference pairs,
    # rl.group_size for GRPO's groups (a prompt's completions), 1 else
    media_copies: int = 1
    # The decoder's sliding window in tokens (`model.llm.window.size` where some layer has it;
    # 0: none): block-sparse buckets carry the windowed layers' own tile list
    # (`jaxmllm.batch.bucketize.window_tile_cap`)
    window: int = 0
    # The encoder phases whose items' tokens attend to each other both ways in the decoder
    # (`model.llm.bidirectional`): their spans' tiles above the diagonal count in the LLM's
    bidirectional: tuple[str, ...] = ()

    @property
    def group_row_len(self) -> int:
        """Tokens of one LLM row of a bucket: a context group's row, `context` devices' rows
        long; the most LLM tokens one sample may have."""
        return self.context * self.llm_row_len

    def at(self, variant: int) -> BatchSpec:
        """The spec of a step of `variant` as one context degree: with a degree per step
        (`long_context`), a long variant's LLM buckets are its groups; else this spec."""
        if not self.long_context:
            return self
        degree = self.long_context if variant else self.context
        return dataclasses.replace(self, context=degree, long_context=0)

    @property
    def top(self) -> BatchSpec:
        """The spec of the longest rows a step plans (what the data's longest samples must
        fit): with a degree per step the long variants' groups, even before the ladder's tiles
        are sized; else this spec."""
        return self.at(1)

    @property
    def tiled(self) -> bool:
        """Whether buckets compute tiles (block-sparse attention): a tile capacity per phase."""
        return self.attention == "block_sparse"

    def input_dtype(self, phase: str) -> np.dtype:
        """The dtype of a phase's inputs array in the batch."""
        return np.dtype(self.inputs.get(phase, Inputs()).numpy_dtype)

    def tile_caps(self, variant: int = 0) -> Mapping[str, int]:
        """Per phase, the tiles a bucket computes (block-sparse attention; else empty) in a
        step of `variant` (0: the base; v: the long variant v, `long_tiles`).

        Raises:
          ConfigError: a tile capacity still -1 (auto), naming its key.
        """
        keys = [k for k in self.unresolved if k.endswith("_tiles")]
        if keys:
            named = ", ".join(f"batch.{k}" for k in keys)
            raise ConfigError(f"{named}=-1 or [-1] (auto) is not resolved: {RESOLVE}")
        return variant_tiles(self.tiles, self.long_tiles, variant)

    @property
    def variants(self) -> int:
        """The step's variants: the base one and each long one."""
        return 1 + len(self.long_tiles)

    @classmethod
    def of(cls, cfg: Any, *, resolved: bool = True) -> BatchSpec:
        """The spec of a `Config`: resolved (default), or as the data has sized it so far.

        Raises:
          ConfigError: (resolved) a size still -1 (auto), naming its key.
        """
        mesh = cfg.mesh
        if mesh.context_steps == "auto" and resolved:
            raise ConfigError(
                "mesh.context_steps=auto is not resolved: it is chosen from the data at start-up "
                "(jaxmllm.resolve.degree; the trainer does), or set long or all"
            )
        per_step = mesh.context_steps == "long" and mesh.context > 1  # (the base: no groups)
        context = 1 if per_step else mesh.context
        spec = cls.from_sections(cfg.model, cfg.batch, cfg.data, context, resolved)
        if per_step:  # (groups in a long variant: one with the base's tiles where none is set)
            long = spec.long_tiles or ({p: 0 for p in (LLM, *spec.units)},)
            spec = dataclasses.replace(spec, long_context=mesh.context, long_tiles=long)
        train = getattr(cfg, "train", None)
        if train is not None and train.objective == "dpo":
            given = cfg.preference.reference == "precomputed" and cfg.preference.loss != "simpo"
            spec = dataclasses.replace(spec, pairs=True, pair_reference=given, media_copies=2)
        if train is not None and train.objective == "grpo":
            spec = dataclasses.replace(spec, media_copies=cfg.rl.group_size)
        return dataclasses.replace(spec, context_strategy=cfg.mesh.context_strategy)

    @classmethod
    def from_sections(
        cls, m: Any, b: Any, data: Any = None, context: int = 1, resolved: bool = True
    ) -> BatchSpec:
        """The spec of a ModelConfig and BatchConfig (see `of`); `data` (a DataConfig) gives
        pixels' normalisation (default: data.image_mean's and image_std's defaults),
        `context` the mesh's context groups."""
        unresolved = []
        if m.attention == "auto":  # (what the kernel is decides tiles or documents)
            if resolved:
                raise ConfigError(
                    "model.attention=auto is not resolved: resolve it for the devices first "
                    "(jaxmllm.resolve.attention.resolve_attention; the trainer does)"
                )
            unresolved.append("model.attention")
        on = in_batch(m, b)  # (a zero bucket: the step leaves that encoder out)
        tiles = {LLM: "llm_tiles", **{p.name: p.tiles for p in on}}
        docs = {LLM: "llm_documents", **{p.name: p.documents for p in on}}
        bounded = documents_bounded(m)
        need = {"route_pair_capacity": b.route_pair_capacity}
        sparse = m.attention == "block_sparse"
        unresolved += [k for k in tiles.values() if sparse and getattr(b, k) < 0]
        # (the long variants' [-1] is sized with the tiles when those are auto; else none)
        longs = {LLM: "llm_long_tiles", **{p.name: p.long_tiles for p in on}}
        ladder = {p: () if getattr(b, k) == (-1,) else getattr(b, k) for p, k in longs.items()}
        count = max([len(v) for v in ladder.values()], default=0) if sparse else 0
        if m.attention == "cudnn":
            need.update({key: getattr(b, key) for key in docs.values()})
        for key, value in need.items():
            if value < 0 and resolved:
                raise ConfigError(f"batch.{key}={value} (auto) is not resolved: {RESOLVE}")
            if value < 0:
                unresolved.append(key)
        return cls(
            microbatches=b.microbatches,
            llm_rows=b.llm_rows,
            llm_row_len=b.llm_row_len,
            units={p.name: p.bucket(b) for p in on},
            route_pair_capacity=b.route_pair_capacity,
            exchange=b.exchange,
            attention_block=b.attention_block,
            tiles={p: getattr(b, key) for p, key in tiles.items() if getattr(b, key) >= 0}
            if sparse
            else {},
            documents={
                p: getattr(b, key)
                for p, key in docs.items()
                if p in bounded
                and (m.attention == "cudnn" or getattr(b, key) > 0)
                and getattr(b, key) >= 0
            },
            unresolved=tuple(unresolved),
            long_tiles=tuple(
                {p: v[k] if len(v) > k else 0 for p, v in ladder.items()} for k in range(count)
            ),
            inputs={p.name: inputs_of(p, data, m.compute_dtype) for p in on},
            context=context,
            attention=m.attention,
            devices_per_host=max(b.devices_per_host, 0),
            per_token={p.name: p.per_token(m) for p in ENCODERS},
            per_row={p.name: p.per_row(m) for p in ENCODERS},
            sample_units={p.name: p.bucket(b) for p in enabled(m)} if b.capacity == "fixed" else {},
            window=m.llm.window.size if m.llm.window.enabled else 0,
            bidirectional=tuple(m.llm.bidirectional),
        )


def variant_tiles(
    tiles: Mapping[str, int], long_tiles: tuple[Mapping[str, int], ...], variant: int
) -> dict[str, int]:
    """Per phase of `tiles`, the tiles of a step of `variant`: the base's, each long variant
    up to `variant` raising the phases it sets (0: the variant below's)."""
    out = dict(tiles)
    for long in long_tiles[:variant]:
        out.update({p: n for p, n in long.items() if n and p in out})
    return out


def inputs_of(p: Any, data: Any = None, compute_dtype: str = "float32") -> Inputs:
    """How phase `p`'s inputs travel: pixels as uint8 (normalised by `data`'s image_mean and
    image_std on the device), features as bfloat16 under bf16 compute, else float32."""
    if not p.pixels:
        return Inputs("bfloat16" if compute_dtype == "bfloat16" else "float32")
    return Inputs.pixels() if data is None else Inputs.pixels(data.image_mean, data.image_std)


def documents_bounded(m: Any) -> tuple[str, ...]:
    """The phases whose rows `batch.*_documents` bounds for a ModelConfig: every phase with
    cuDNN's packed layout (required); otherwise the encoders with class tokens (a row for each
    image after the row's units; unbounded, the encoder takes one for every token's worth)."""
    if m.attention == "cudnn":
        return (LLM, *(p.name for p in enabled(m)))
    return tuple(p.name for p in enabled(m) if getattr(p.encoder(m), "class_token", False))
