"""Typed experiment configs: frozen dataclasses loaded from YAML with dotted overrides.

Every field carries a docstring-style comment. Loading rejects unknown keys (naming the closest
valid one), wrong types and failed checks, always naming the key and the file, so a bad config
stops the run at start-up with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxmllm.plan.registry import PLANNERS

AUTO_SIZES = ("route_pair_capacity", "llm_tiles", "vision_tiles", "audio_tiles", "llm_documents",
              "vision_documents", "audio_documents", "devices_per_host")  # fmt: skip


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and source."""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh. Axis sizes multiply to the device count; -1 takes the remaining devices."""

    data: int = -1  # pure data parallelism (replicated params); slowest axis, spans hosts
    fsdp: int = 1  # data parallelism with params/optimizer state sharded over this axis
    tensor: int = 1  # tensor parallelism (heads, MLP width, vocab); fastest axis
    cpu_devices: int = 0  # split CPU-only hosts into this many devices, all processes; 0 = as is


@dataclass(frozen=True)
class VisionConfig:
    """ViT over packed native-resolution patches (no fixed image size)."""

    enabled: bool = True  # build the vision encoder and feed images
    patch_size: int = 14  # patch side in pixels
    channels: int = 3  # image channels (RGB)
    width: int = 1024  # hidden size
    depth: int = 24  # transformer layers
    heads: int = 16  # attention heads
    mlp_dim: int = 4096  # gated-MLP inner width
    merge: int = 2  # projector merges merge x merge neighbouring patches into one LLM token
    rope_theta: float = 10000.0  # 2D rotary base
    freeze: bool = False  # no gradient and no optimizer state for the encoder

    def __post_init__(self):
        _positive(self, "patch_size", "channels", "width", "depth", "heads", "mlp_dim", "merge")
        _check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        _check(
            (self.width // self.heads) % 4 == 0,
            "head dim must be divisible by 4 (2D RoPE)",
            "heads",
        )


@dataclass(frozen=True)
class AudioConfig:
    """Audio encoder: strided conv subsampling of packed log-mel frames, then a transformer."""

    enabled: bool = True  # build the audio encoder and feed audio clips
    n_mels: int = 80  # mel bins per frame
    subsample: int = 4  # frames per encoder output row (two stride-2 convs = 4)
    width: int = 768  # hidden size
    depth: int = 12  # transformer layers
    heads: int = 12  # attention heads
    mlp_dim: int = 3072  # gated-MLP inner width
    rope_theta: float = 10000.0  # rotary base
    freeze: bool = False  # no gradient and no optimizer state for the encoder

    def __post_init__(self):
        _positive(self, "n_mels", "width", "depth", "heads", "mlp_dim")
        _check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        _check((self.width // self.heads) % 2 == 0, "head dim must be even (RoPE)", "heads")
        _check(
            self.subsample == 4, "only subsample=4 (two stride-2 convs) is implemented", "subsample"
        )


@dataclass(frozen=True)
class LLMConfig:
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, gated MLP."""

    vocab_size: int = 32000  # tokenizer vocabulary incl. special tokens
    width: int = 2048  # hidden size
    depth: int = 16  # decoder layers
    heads: int = 16  # query heads
    kv_heads: int = 4  # key/value heads (GQA); must divide heads
    mlp_dim: int = 5632  # gated-MLP inner width
    rope_theta: float = 10000.0  # rotary base
    tie_embeddings: bool = False  # share input embedding and output projection
    freeze: bool = False  # no gradient and no optimizer state for the decoder

    def __post_init__(self):
        _positive(self, "vocab_size", "width", "depth", "heads", "kv_heads", "mlp_dim")
        _check(self.width % self.heads == 0, "width must be divisible by heads", "width")
        _check((self.width // self.heads) % 2 == 0, "head dim must be even (RoPE)", "heads")
        _check(self.heads % self.kv_heads == 0, "kv_heads must divide heads", "kv_heads")
        _check(self.vocab_size >= 264, "the byte tokenizer needs at least 264 ids", "vocab_size")


@dataclass(frozen=True)
class ModelConfig:
    """Encoders + projectors + LLM; each module replaceable and freezable."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    projector_freeze: bool = False  # freeze both projectors
    compute_dtype: str = "float32"  # activations/matmuls: float32 or bfloat16 (params stay fp32)
    param_dtype: str = "float32"  # master weights
    remat: bool = False  # rematerialise each transformer block in the backward pass
    # With remat, what each block keeps for the backward pass: nothing (only its input: least
    # memory, the forward runs twice) | dots (also its weight matmuls' outputs q, k, v, out,
    # gate, up, down: up to 4 * width + 2 * mlp_dim more values per token and layer, and only
    # attention and elementwise ops are recomputed)
    remat_policy: str = "nothing"
    # How attention reads packed rows: block_sparse computes only the (query block, key block)
    # tiles the documents span, listed by the planner (batch.*_tiles, batch.attention_block) |
    # dense: every pair of a row, masked (the reference; memory and time grow with row_len^2) |
    # cudnn: cuDNN's fused attention over the packed documents (GPU only)
    attention: str = "block_sparse"

    def __post_init__(self):
        _check(self.attention in ATTENTIONS, f"must be one of {', '.join(ATTENTIONS)}", "attention")
        for key in ("compute_dtype", "param_dtype"):
            _check(
                getattr(self, key) in ("float32", "bfloat16"), "must be float32 or bfloat16", key
            )
        _check(
            self.remat_policy in REMAT_POLICIES,
            f"must be one of {', '.join(REMAT_POLICIES)}",
            "remat_policy",
        )


REMAT_POLICIES = ("nothing", "dots")  # jaxmllm.models.transformer.REMAT_POLICIES implements each
ATTENTIONS = ("block_sparse", "dense", "cudnn")


@dataclass(frozen=True)
class BatchConfig:
    """Per-step batch contract: per device and per microbatch, fixed-capacity buckets."""

    microbatches: int = 1  # gradient-accumulation microbatches per step
    llm_rows: int = 1  # packed LLM rows per device per microbatch
    llm_row_len: int = 4096  # tokens per LLM row; a sample never crosses a row
    vision_patches: int = 4096  # ViT patch capacity per device per microbatch (one packed row)
    audio_frames: int = 3072  # log-mel frame capacity per device per microbatch (one packed row)
    route_pair_capacity: int = -1  # rows a device may send another (0: local; -1: dry run's most)
    devices_per_host: int = -1  # routing stays within a host first; -1 = a process's devices
    exchange: str = "dense"  # dense all_to_all (every backend) | ragged (ragged_all_to_all: GPU)
    planner: str = "orchestrated"  # a name of jaxmllm.plan.registry.PLANNERS (orchestrated |
    # balanced | grain | naive | first_fit)
    capacity: str = "fixed"  # fixed: the sizes above; auto: encoder buckets sized from the data
    # Block-sparse attention: tokens (patches, audio encoder rows) per side of a tile, and the
    # tiles a device computes per microbatch in each phase (its tile lists are padded to these).
    # -1 = auto: sized from the data (orchestrated: the mean need plus a margin, which it never
    # exceeds; other planners: the most any of their buckets needs over the run, a dry run).
    attention_block: int = 128
    llm_tiles: int = -1
    vision_tiles: int = -1
    audio_tiles: int = -1
    # cuDNN attention (model.attention: cudnn): the most documents one row of each phase holds,
    # a static size of cuDNN's packed layout (its backward workspace grows with it, ~8 MiB per
    # document at 2048 tokens, 8 heads of 64). -1 = auto: the row over the data's smallest
    # document, which no row can exceed; a row with more is refused naming the key.
    llm_documents: int = -1
    vision_documents: int = -1
    audio_documents: int = -1

    def __post_init__(self):
        for key in ("microbatches", "llm_rows", "llm_row_len"):
            _check(getattr(self, key) >= 1, "must be >= 1", key)
        _check(self.vision_patches % 4 == 0, "must be a multiple of 4", "vision_patches")
        _check(self.audio_frames % 4 == 0, "must be a multiple of 4", "audio_frames")
        _check(self.planner in PLANNERS, f"must be one of {sorted(PLANNERS)}", "planner")
        _check(self.capacity in ("fixed", "auto"), "must be fixed or auto", "capacity")
        _check(self.exchange in ("dense", "ragged"), "must be dense or ragged", "exchange")
        _check(self.route_pair_capacity >= -1, "must be >= 0, or -1", "route_pair_capacity")
        _check(self.attention_block >= 1, "must be >= 1", "attention_block")
        for key in AUTO_SIZES[1:]:  # (route_pair_capacity may also be 0)
            _check(getattr(self, key) >= 1 or getattr(self, key) == -1, "must be >= 1, or -1 "
                   "for auto (resolved at start-up)", key)  # fmt: skip
        _check(
            self.planner != "orchestrated" or self.route_pair_capacity != 0,
            "orchestrated routes encoder rows between devices: set route_pair_capacity "
            "> 0, or -1 for auto",
            "route_pair_capacity",
        )


@dataclass(frozen=True)
class SyntheticConfig:
    """Built-in learnable data: shapes with captions, tones with captions, text patterns."""

    num_samples: int = 4096  # samples per epoch
    image_fraction: float = 0.4  # share of samples with one or more images
    multi_image_fraction: float = 0.1  # share with two images
    audio_fraction: float = 0.25  # share with an audio clip
    min_image_side: int = 4  # image side in patches (even numbers are used)
    max_image_side: int = 16  # largest image side in patches
    min_audio_frames: int = 16  # shortest clip in log-mel frames
    max_audio_frames: int = 128  # longest clip in log-mel frames
    max_text_words: int = 24  # longest text-only sample in words


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from, how they are preprocessed, and what happens to bad input."""

    source: str = "synthetic"  # synthetic (built in) | jsonl (a manifest) | arrayrecord
    path: str = ""  # the JSONL manifest or .array_record file (jsonl / arrayrecord sources)
    index_dir: str = ""  # lengths index from `python -m jaxmllm.data.index`; "" = <path>.index
    tokenizer: str = "byte"  # byte, or the path of a HuggingFace tokenizer.json (no downloads)
    image_min_pixels: int = 3136  # smaller images are upscaled to about this many pixels
    image_max_pixels: int = 1003520  # larger images are downscaled to at most this many pixels
    audio_sample_rate: int = 16000  # clips are resampled to this rate (Hz); 10 ms mel hop
    audio_max_frames: int = 3000  # longest clip in log-mel frames; longer clips become chunks
    # Decompression-bomb caps, checked on the file header before any pixel or sample is decoded
    # (index and loader alike); a file over a cap is rejected (image_too_large, audio_too_long).
    max_image_pixels: int = 1 << 26  # width x height of a stored image (64 Mpx = 8192 x 8192)
    max_audio_seconds: float = 600.0  # length of a clip from its header (frames / rate)
    on_error: str = "skip"  # bad or missing media, bad lines, placeholder mismatch: skip | fail
    on_oversize: str = "shrink"  # a sample no bucket can hold: shrink | truncate | skip | fail
    workers: int = 0  # preprocessing worker processes; 0 = in the training process
    seed: int = 0  # shuffling and generation seed
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def __post_init__(self):
        _check(self.source in DATA_SOURCES, f"must be one of {sorted(DATA_SOURCES)}", "source")
        _check(
            self.source == "synthetic" or bool(self.path),
            f"source {self.source} needs data.path (the manifest or .array_record file)",
            "path",
        )
        _check(self.on_error in ("skip", "fail"), "must be skip or fail", "on_error")
        _check(
            self.on_oversize in ("shrink", "truncate", "skip", "fail"),
            "must be shrink, truncate, skip or fail",
            "on_oversize",
        )
        _check(self.image_min_pixels >= 1, "must be >= 1", "image_min_pixels")
        _check(
            self.image_max_pixels >= self.image_min_pixels,
            "must be >= image_min_pixels",
            "image_max_pixels",
        )
        _check(self.audio_sample_rate >= 1000, "must be >= 1000 Hz", "audio_sample_rate")
        _check(
            self.audio_max_frames >= 4 and self.audio_max_frames % 4 == 0,
            "must be a positive multiple of 4 (the audio encoder's subsampling)",
            "audio_max_frames",
        )
        _check(self.max_image_pixels >= 1, "must be >= 1", "max_image_pixels")
        _check(self.max_audio_seconds > 0, "must be > 0", "max_audio_seconds")
        _check(self.workers >= 0, "must be >= 0", "workers")


DATA_SOURCES = {"synthetic", "jsonl", "arrayrecord"}


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    lr: float = 3e-4  # peak learning rate
    warmup_steps: int = 100  # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio at the last step
    weight_decay: float = 0.1  # decoupled weight decay (not applied to norms/biases)
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    clip_norm: float = 1.0  # global gradient-norm clip; 0 disables


@dataclass(frozen=True)
class TrainConfig:
    """Loop, logging and checkpointing."""

    steps: int = 1000  # total optimizer steps
    seed: int = 0  # parameter init seed
    output_dir: str = "runs/default"  # checkpoints, metrics.jsonl, TensorBoard events
    log_every: int = 10  # write metrics every N steps
    checkpoint_every: int = 100  # save a checkpoint every N steps (and at the end)
    keep_checkpoints: int = 3  # how many recent checkpoints to keep
    async_checkpointing: bool = True  # write checkpoints in the background
    progress_bar: bool = True  # tqdm bar on the terminal
    max_nonfinite_steps: int = 5  # stop after this many skipped (NaN/inf) steps in a row; 0 = never
    ledger: bool = False  # write the sample ids of every step to <output_dir>/ledger/ (audits)
    record_timings: bool = True  # each step's time and work to timings.jsonl (calibration)
    cost_file: str = ""  # calibrated cost model (data.cost --calibrate): predicted step time

    def __post_init__(self):
        _positive(self, "steps", "log_every", "checkpoint_every", "keep_checkpoints")
        _check(
            self.max_nonfinite_steps >= 0, "must be >= 0 (0 = never stop)", "max_nonfinite_steps"
        )


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (`jax.distributed`): one process per host, or per GPU.

    Empty / -1 fields come from the environment: JAXMLLM_COORDINATOR, JAXMLLM_NUM_PROCESSES,
    JAXMLLM_PROCESS_ID (set by `launch/`), else JAX's cluster auto-detection (SLURM, Open MPI)
    when a cluster job with more than one task is detected. Nothing set: a single process.
    """

    coordinator: str = ""  # host:port of process 0's coordination service
    num_processes: int = -1  # processes in the job
    process_id: int = -1  # this process, 0 .. num_processes-1
    init_timeout_s: int = 300  # wait this long for every process to join at start-up
    heartbeat_timeout_s: int = 60  # a process silent this long is declared dead; the others stop
    step_timeout_s: int = 600  # a step (or a collective) stuck this long stops the process

    def __post_init__(self):
        _positive(self, "init_timeout_s", "heartbeat_timeout_s", "step_timeout_s")
        _check(
            self.num_processes == -1 or self.num_processes >= 1,
            "must be >= 1, or -1 (from the environment)",
            "num_processes",
        )
        _check(self.process_id >= -1, "must be >= 0, or -1 (from the environment)", "process_id")
        _check(
            not self.coordinator or ":" in self.coordinator,
            f"{self.coordinator!r} must be host:port",
            "coordinator",
        )


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

    def __post_init__(self):
        vis, b = self.model.vision, self.batch
        _check(
            b.vision_patches % (vis.merge**2) == 0,
            f"must be a multiple of merge^2 = {vis.merge**2}",
            "batch.vision_patches",
        )
        if self.model.attention == "block_sparse":
            self._check_blocks()

    def _check_blocks(self) -> None:
        """Block-sparse attention cuts every packed row into blocks of batch.attention_block."""
        b, m = self.batch, self.model
        block, fix = b.attention_block, "(or set model.attention: dense)"
        _check(
            b.llm_row_len % block == 0,
            f"must be a multiple of batch.attention_block={block} {fix}",
            "batch.llm_row_len",
        )
        if b.capacity == "auto":  # the encoder buckets are sized from the data, in blocks
            return
        _check(
            not m.vision.enabled or b.vision_patches % block == 0,
            f"must be a multiple of batch.attention_block={block} {fix}",
            "batch.vision_patches",
        )
        rows = b.audio_frames // m.audio.subsample
        _check(
            not m.audio.enabled or rows % block == 0,
            f"must be a multiple of batch.attention_block x model.audio.subsample = "
            f"{block * m.audio.subsample} (the audio encoder attends over frames / "
            f"{m.audio.subsample}) {fix}",
            "batch.audio_frames",
        )


def _positive(section, *keys: str) -> None:
    for key in keys:
        _check(getattr(section, key) >= 1, "must be >= 1", key)


def _check(ok: bool, message: str, key: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


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
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(Config, raw, source=source)


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. optim.lr=3e-4")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(value) if value.strip() else ""


def from_dict(cls: type, raw: Any, *, source: str = "<dict>", prefix: str = "") -> Any:
    """Builds dataclass `cls` from nested dicts, checking keys and types."""
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
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
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
    if tp in (float, str) and not isinstance(value, tp):
        raise ConfigError(f"{source}: {key} must be a {tp.__name__}, got {value!r}")
    return value


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)
