"""A whole experiment (`Config`), read from YAML with dotted overrides, checked on the way.

Loading rejects unknown keys (naming the closest valid one), wrong types and failed checks,
always naming the key and the file.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxmllm.config import phases
from jaxmllm.config.checks import ConfigError, check
from jaxmllm.config.data import BYTE_VOCAB
from jaxmllm.config.model import ModelConfig
from jaxmllm.config.phases import ENCODERS, NAMES
from jaxmllm.config.rl import RLConfig, check_objective
from jaxmllm.config.sections import (
    BatchConfig,
    DataConfig,
    DistributedConfig,
    MeshConfig,
    OptimConfig,
    PipelineConfig,
    PreferenceConfig,
    TrainConfig,
)
from jaxmllm.config.yamlfile import read_yaml, shown


@dataclass(frozen=True)
class Config:
    """A whole experiment."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self):
        for p in ENCODERS:  # (whole LLM tokens: the projector merges this many units into one)
            per = p.per_token(self.model)
            check(
                p.bucket(self.batch) % per == 0,
                f"must be a multiple of {per}, the {p.unit} of one LLM token (model.{p.name})",
                f"batch.{p.capacity}",
            )
        aud = self.model.audio
        check(
            not aud.enabled
            or aud.positions != "sinusoidal"
            or self.data.audio_max_frames <= aud.max_positions * aud.stride,
            f"a clip of up to {self.data.audio_max_frames} frames needs "
            f"{self.data.audio_max_frames // aud.stride} rows of the audio encoder's position "
            f"table, which has model.audio.max_positions={aud.max_positions}; set "
            f"data.audio_max_frames <= {aud.max_positions * aud.stride} (longer clips are cut "
            "into chunks)",
            "data.audio_max_frames",
        )
        if self.data.source == "synthetic" and self.data.synthetic.video_fraction:
            self._check_synthetic_video()
        if self.model.attention in ("block_sparse", "auto"):  # (auto may resolve to it)
            self._check_blocks()
        check(  # (a config without data is refused where data is needed, saying so)
            self.data.eval.source != "synthetic" or self.data.source in ("synthetic", "none"),
            "synthetic (a held-out share of the built-in data) needs data.source: synthetic; "
            "set data.eval.source: none, or jsonl / arrayrecord with a held-out data.eval.path",
            "data.eval.source",
        )
        # Byte ids: the built-in data's, or a data set's under data.tokenizer: byte (another
        # tokenizer's size is checked when the source opens; a config without data, an HF
        # checkpoint's own, needs none)
        d = self.data
        bytes_ = d.source == "synthetic" or (d.tokenizer == "byte" and (d.path or d.sources))
        check(
            not bytes_ or self.model.llm.vocab_size >= BYTE_VOCAB,
            f"the byte tokenizer needs at least {BYTE_VOCAB} ids (256 bytes and 8 reserved "
            f"specials){' (the built-in data is bytes)' if d.source == 'synthetic' else ''}: "
            "raise it, or set data.tokenizer to a checkpoint's tokenizer",
            "model.llm.vocab_size",
        )
        self._check_trains()
        # What the model is (linear layers, M-RoPE) is refused before a setting that can change
        # (attention, planner): the first refusal is the reason, its advice keeps the model.
        if self.model.llm.linear.enabled:
            self._check_linear()
        llm = self.model.llm
        check(
            self.mesh.stage == 1 or not (llm.per_layer_dim or llm.kv_shared_layers),
            f"{self.mesh.stage}: a decoder with per-layer inputs or layers reusing keys and "
            "values (model.llm.per_layer_dim, kv_shared_layers) hands its stages more than the "
            "hidden states; pipeline stages are not built for it: set mesh.stage: 1",
            "mesh.stage",
        )
        check(
            self.mesh.stage == 1 or not self.model.llm.window.enabled,
            f"{self.mesh.stage}: a decoder with sliding-window layers (model.llm.window) stacks "
            "its windowed and full layers apart, and pipeline stages run one kind of layer; "
            "set mesh.stage: 1",
            "mesh.stage",
        )
        check(
            self.mesh.context == 1 or not self.model.llm.bidirectional,
            f"{self.mesh.context}: the decoder's bidirectional spans (model.llm.bidirectional) "
            "are not built into the context split, which deals a row's query blocks to the "
            "ranks with causal tiles only; set mesh.context: 1",
            "mesh.context",
        )
        check(
            self.mesh.context_steps == "all" or self.mesh.context > 1,
            f"{self.mesh.context_steps} splits the long steps' rows over context groups of "
            "mesh.context devices: set mesh.context > 1 (the groups' size), or "
            "mesh.context_steps: all",
            "mesh.context_steps",
        )
        if self.mesh.context > 1:
            self._check_context()
        if self.mesh.stage > 1:
            self._check_pipeline()
        if self.model.llm.moe.enabled or self.mesh.expert > 1:
            self._check_experts()
        if self.train.objective != "sft":
            check_objective(self.train, self.mesh, self.rl, self.preference)

    def _check_synthetic_video(self) -> None:
        """The built-in videos are encoded by the vision encoder, in whole temporal patches of
        whole merge blocks."""
        v, syn = self.model.vision, self.data.synthetic
        check(
            v.video or not v.enabled,  # (without a vision encoder: refused as images are)
            "needs model.vision.video: true, or set it to 0",
            "data.synthetic.video_fraction",
        )
        check(
            syn.video_side % v.merge == 0,
            f"must be a multiple of model.vision.merge={v.merge}",
            "data.synthetic.video_side",
        )
        check(
            syn.min_video_frames >= v.temporal_patch,
            f"must be at least model.vision.temporal_patch={v.temporal_patch} (one temporal patch)",
            "data.synthetic.min_video_frames",
        )

    def _check_trains(self) -> None:
        """Something trains: a run whose every parameter is frozen only spends its steps (the
        stage-1 recipe on an LLM alone: no encoder, so no projector either)."""
        m = self.model
        encoders = [p for p in ENCODERS if p.enabled(m)]
        trains = not m.llm.freeze or any(not p.encoder(m).freeze for p in encoders)
        keys = ["model.llm.freeze", *(f"model.{p.name}.freeze" for p in encoders)]
        if encoders:
            trains, keys = trains or not m.projector_freeze, [*keys, "model.projector_freeze"]
        off = " and ".join(f"model.{p.name}" for p in ENCODERS)
        why = "" if encoders else f" ({off}: disabled, so there is no projector to train)"
        check(
            trains,
            f"nothing trains: {', '.join(k + '=true' for k in keys)}{why}; set one of them to "
            "false",
            keys[0],
        )

    def _check_context(self) -> None:
        """Context parallelism deals a row's query blocks of block-sparse attention to the
        ranks, and plans its LLM rows per group: the one planner that does is orchestrated.
        (M-RoPE trains split: the batch carries each token's index in its document,
        `llm_order`, which the split's causal mask reads instead of the rotary positions;
        DeepStack's additions travel with their phase's rows, gathered over the group as
        they are.)"""
        check(
            self.model.attention in ("block_sparse", "auto"),  # (auto: block_sparse then)
            f"must be block_sparse with mesh.context={self.mesh.context} (the context ranks "
            "attend over the tiles of the query blocks dealt to them), or set mesh.context: 1",
            "model.attention",
        )
        check(
            self.batch.planner == "orchestrated",
            f"must be orchestrated with mesh.context={self.mesh.context} (it plans LLM rows per "
            "context group and routes encoder rows to the rank holding each placeholder), or "
            "set mesh.context: 1",
            "batch.planner",
        )
        if self.mesh.context_strategy == "ulysses":
            self._check_ulysses()

    def _check_ulysses(self) -> None:
        """Ulysses splits each attention's heads (those of a tensor rank, where mesh.tensor
        splits them) evenly over the context group, and each Gated DeltaNet layer's value
        heads: a count that does not divide is refused, naming both keys. Fewer key/value
        heads than the group are repeated (`models.context.ulysses_attend`), and so are the
        Gated DeltaNet's key heads, each copy with its share of its value heads
        (`models.context.ulysses_linear`)."""
        llm, c, t = self.model.llm, self.mesh.context, self.mesh.tensor
        split = t > 1 and llm.heads % t == 0 and llm.kv_heads % t == 0  # (as attention's)
        heads = llm.heads // t if split else llm.heads
        per = f" per tensor rank (mesh.tensor={t})" if split else ""
        check(
            heads % c == 0,
            f"{llm.heads}: mesh.context_strategy: ulysses splits the {heads} attention heads"
            f"{per} over the context group's mesh.context={c} devices, which must divide "
            "them; set mesh.context to a divisor, or mesh.context_strategy: gather",
            "model.llm.heads",
        )
        lin = llm.linear
        if not lin.enabled:
            return
        split = t > 1 and lin.key_heads % t == 0  # (the conv's channels lie by key head)
        values = lin.value_heads // t if split else lin.value_heads
        per = f" per tensor rank (mesh.tensor={t})" if split else ""
        check(
            values % c == 0,
            f"{lin.value_heads}: mesh.context_strategy: ulysses splits the Gated DeltaNet "
            f"layers' {values} value heads{per} (with the key heads they read, repeated where "
            f"fewer than the group) over mesh.context={c} devices, which must divide "
            "them; set mesh.context to a divisor",
            "model.llm.linear.value_heads",
        )

    def _check_experts(self) -> None:
        """Expert parallelism splits a mixture of experts' experts evenly; what the MoE decoder
        does not run with is refused, naming both keys."""
        moe, ep = self.model.llm.moe, self.mesh.expert
        check(
            moe.enabled,
            f"{ep} splits the experts of a mixture-of-experts decoder, and model.llm.moe.experts "
            "is 0 (a dense decoder): set mesh.expert: 1, or give the decoder experts",
            "mesh.expert",
        )
        check(
            moe.experts % ep == 0,
            f"{ep} must divide model.llm.moe.experts={moe.experts} (each device holds "
            f"experts / mesh.expert of them): set mesh.expert to a divisor of {moe.experts}",
            "mesh.expert",
        )
        check(
            self.mesh.stage == 1,
            f"{self.mesh.stage}: a mixture-of-experts decoder does not run in pipeline stages "
            "(its token all-to-alls inside the stages' shard_map): set mesh.stage: 1 and spread "
            "the experts with mesh.expert instead",
            "mesh.stage",
        )

    def _check_linear(self) -> None:
        """Linear-attention layers carry a state through a row in token order: what that does
        not run with is refused, naming the key."""
        # Context parallelism deals a row's query blocks to the ranks for equal tiles (not in
        # order), so no rank holds a document's tokens before another's: the state cannot be
        # handed from rank to rank.
        # Under ulysses each rank holds the group's every token of its heads, which the layer
        # puts back in the row's order (`jaxmllm.models.context.ulysses_linear`).
        check(
            self.mesh.context == 1 or self.mesh.context_strategy == "ulysses",
            f"{self.mesh.context}: a decoder with linear-attention layers (model.llm.linear) "
            "carries each document's state through its tokens in order, and "
            "mesh.context_strategy: gather deals a row's blocks to the ranks out of order "
            "and keeps them there; set mesh.context_strategy: ulysses (each rank runs the "
            "layer over the whole group's tokens, in order, for its heads) or mesh.context: 1",
            "mesh.context",
        )
        check(
            self.mesh.stage == 1,
            f"{self.mesh.stage}: a decoder with linear-attention layers stacks its two kinds "
            "of layers apart, and pipeline stages run one kind; set mesh.stage: 1",
            "mesh.stage",
        )

    def _check_pipeline(self) -> None:
        """Layer counts given per stage add up to the module's depth; placements name encoders
        that exist; what the pipeline does not run is refused, naming both keys."""
        p, m = self.pipeline, self.model
        for name in ("llm", *NAMES):
            layers, depth = p.layers(name), getattr(m, name).depth
            check(
                not layers or sum(layers) == depth,
                f"{list(layers)} adds up to {sum(layers)} layers, but model.{name}.depth is "
                f"{depth}",
                f"pipeline.{name}_layers",
            )
        for phase in ENCODERS:
            name = phase.name
            check(
                phase.enabled(m) or (p.placement(name) != "stages" and not p.layers(name)),
                f"model.{name}.enabled is false: there is no {name} encoder to place",
                f"pipeline.{name}",
            )
            check(
                not p.layers(name) or p.placement(name) == "stages",
                f"layers per {name} stage need pipeline.{name}: stages",
                f"pipeline.{name}_layers",
            )
            check(
                p.placement(name) != "stages" or phase.encoder(m).stages_ok,
                f"the {name} tower's options (model.{name}: class_token, window, final_norm: "
                f"false, deepstack, pool) run only as a whole tower: set pipeline.{name}: data "
                "(or auto)",
                f"pipeline.{name}",
            )
        # Not (yet) run inside the pipeline's shard_map over the stages.
        stage = f"with mesh.stage={self.mesh.stage} (pipeline stages)"
        check(
            not (m.vision.enabled and m.vision.deepstack),
            f"{list(m.vision.deepstack)} (DeepStack: the tower's features added in the LLM's "
            f"first layers) is not supported {stage}: set mesh.stage: 1",
            "model.vision.deepstack",
        )
        check(
            self.mesh.context == 1,
            f"context parallelism is not supported {stage}: set mesh.context: 1 or mesh.stage: 1",
            "mesh.context",
        )
        # XLA's SPMD partitioner, on the collectives it places inside the tick loop's per-stage
        # branches, aborts (a replica-group check) or waits forever (a collective-permute that
        # half the devices never reach) with fsdp and tensor both split; and with tensor split
        # beside data-parallel buckets, when the loss's vocabulary split is left to it.
        check(
            self.mesh.fsdp == 1 or self.mesh.tensor == 1,
            f"with mesh.fsdp={self.mesh.fsdp} is not supported {stage}: split the layers over "
            "fsdp or over tensor, not both (set mesh.tensor: 1 or mesh.fsdp: 1)",
            "mesh.tensor",
        )
        check(
            self.mesh.tensor == 1 or m.llm.vocab_parallel,
            f"false with mesh.tensor={self.mesh.tensor} is not supported {stage}: set "
            "model.llm.vocab_parallel: true (the loss split by vocabulary) or mesh.tensor: 1",
            "model.llm.vocab_parallel",
        )

    def _check_blocks(self) -> None:
        """Block-sparse attention cuts every packed row into blocks of batch.attention_block."""
        b, m = self.batch, self.model
        block, fix = b.attention_block, "(or set model.attention: dense)"
        check(
            b.llm_row_len % block == 0,
            f"must be a multiple of batch.attention_block={block} {fix}",
            "batch.llm_row_len",
        )
        if b.capacity == "auto":  # the encoder buckets are sized from the data, in blocks
            return
        for p in phases.enabled(m):
            per = p.per_row(m)  # (units per encoder row: attention tiles are blocks of rows)
            rows = f" x {per} {p.unit} per {p.name} encoder row = {block * per}" if per > 1 else ""
            check(
                p.bucket(b) % (block * per) == 0,
                f"must be a multiple of batch.attention_block={block}{rows} {fix}",
                f"batch.{p.capacity}",
            )


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Reads a YAML file (or the defaults) and applies `a.b=value` overrides.

    Raises:
      ConfigError: naming the key, the file and, for unknown keys, the closest valid name.
    """
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        raw = read_yaml(text, str(path)) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    given = copy.deepcopy(raw) if overrides else raw
    keys = [_apply_override(raw, item) for item in overrides]
    try:
        cfg = from_dict(Config, raw, source=source)
    except ConfigError as e:
        raise _named(e, source, given, list(overrides), keys) from None
    if path is not None:  # (not a field: a command that rebuilds what it needs names it)
        cfg.__dict__["_origin"] = (str(path), [str(o) for o in overrides])
    return cfg


def config_origin(cfg: Config) -> tuple[str, list[str]] | None:
    """(the file, the `--set` overrides) `load_config` read `cfg` from; None for a config
    built otherwise (or copied with changes since)."""
    return cfg.__dict__.get("_origin")


def keep_origin(changed: Config, cfg: Config) -> Config:
    """`changed` (a copy of `cfg` with changes) with `cfg`'s origin: what `config_origin` says."""
    if config_origin(cfg) is not None:
        changed.__dict__["_origin"] = config_origin(cfg)
    return changed


def _named(error: ConfigError, source: str, given: dict, overrides: list, keys: list):
    """`error` of a config with `--set` overrides, named by what caused it: the override(s)
    whose key it names (or all of them) when the file (the defaults) alone loads or fails
    otherwise; the file, as `error` says, when it fails alone the same way."""
    if not overrides:
        return error
    try:
        from_dict(Config, given, source=source)
    except ConfigError as alone:
        if str(alone) == str(error):
            return error  # (the file's own)
    message = str(error).removeprefix(f"{source}: ")
    named = [item for item, key in zip(overrides, keys, strict=True) if key in message]
    return ConfigError(f"--set {' '.join(map(_cut, named or overrides))}: {message}")


def _cut(item: str, most: int = 100) -> str:
    """An override as a message names it: whole up to `most` characters, else its start and
    its length (a 10k-character value is not printed back)."""
    return item if len(item) <= most else f"{item[: most - 20]}... ({len(item):,} characters)"


def _apply_override(raw: dict, item: str) -> str:
    """Sets `item` (key.path=value) in `raw`; returns its dotted key."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {shown(item)}: expected key.path=value, e.g. optim.lr=3e-4")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {shown(item)}: {part} is not a section")
    try:  # (a `!!python/object` tag the safe loader refuses, bad syntax, an alias bomb)
        node[parts[-1]] = read_yaml(value, f"--set {key.strip()}") if value.strip() else ""
    except ConfigError as e:
        raise ConfigError(
            f"{e} (the value {shown(value)}: quote it as a string or give a plain number, list "
            "or mapping)"
        ) from None
    return key.strip()


def from_dict(cls: type, raw: Any, *, source: str = "<dict>", prefix: str = "") -> Any:
    """Builds dataclass `cls` from nested dicts, checking keys and types."""
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
    if hasattr(cls, "upgrade"):  # keys of an older format, read as they are meant now
        raw = cls.upgrade(raw, source)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = closest_name(str(key), list(fields))
            hint = f"; did you mean '{prefix}{close}'?" if close else ""
            valid = ", ".join(fields)
            raise ConfigError(
                f"{source}: unknown key '{prefix}{key}'{hint} (valid keys here: {valid})"
            )
        kwargs[key] = _coerce(hints[key], value, source=source, key=f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        message = str(e)
        if message.startswith(f"{source}: "):  # already located by a nested section
            raise
        raise ConfigError(f"{source}: {prefix}{message}") from None


def closest_name(key: str, names: list[str]) -> str | None:
    """The valid name a user most likely meant: a near spelling, an abbreviation, a substring."""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return close[0]
    initials = "".join(part[:1] for part in key.split("_"))
    for name in names:
        if name == initials or (len(name) > 2 and (name in key or key in name)):
            return name
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.4)
    return close[0] if close else None


def _coerce(tp: Any, value: Any, *, source: str, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source=source, prefix=f"{key}.")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):  # any length: tuple[int, ...]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{source}: {key} must be a list, got {shown(value)}")
        item = typing.get_args(tp)[0]
        return tuple(
            _coerce(item, v, source=source, key=f"{key}[{i}]") for i, v in enumerate(value)
        )
    if origin is tuple:  # fixed-length, e.g. tuple[float, float, float]
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(
                f"{source}: {key} must be a list of {len(args)} values, got {shown(value)}"
            )
        return tuple(
            _coerce(a, v, source=source, key=f"{key}[{i}]")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # (an integer of hundreds of digits)
            raise ConfigError(f"{source}: {key} is over a float's range (1.8e308)") from None
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        # NaN is a number nowhere downstream (a config.json's rope_theta NaN made every loss
        # NaN); infinity only as a cap, where it means none (data.max_audio_seconds: .inf).
        if not (value == math.inf and key.rpartition(".")[2].startswith("max_")):
            raise ConfigError(f"{source}: {key} must be a finite number, got {shown(value)}")
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {shown(value)}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{source}: {key} must be an integer, got {shown(value)}")
    if tp is str and isinstance(value, datetime.date):  # YAML reads 2024-07-26 as a date
        return value.isoformat()
    if tp in (float, str) and not isinstance(value, tp):
        raise ConfigError(f"{source}: {key} must be a {tp.__name__}, got {shown(value)}")
    return value


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts, as JSON reads it back (tuples as lists): what
    checkpoint metadata holds, so a saved config compares equal to the one that wrote it."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))
