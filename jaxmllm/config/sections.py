"""Run sections: the mesh, the batch contract, data, optimizer, loop, multi-process launch."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from jaxmllm.config.checks import check, positive
from jaxmllm.config.phases import ENCODERS, NAMES

# The planners `batch.planner` may name; `jaxmllm.plan.registry.PLANNERS` implements each (a test
# holds the two lists equal: config sits below the planners and names them only).
PLANNER_NAMES = ("orchestrated", "balanced", "grain", "naive", "first_fit")

# The batch sizes -1 leaves to the data (resolved at start-up, kept with the checkpoints)
AUTO_SIZES = (
    "route_pair_capacity",
    "llm_tiles",
    *(p.tiles for p in ENCODERS),
    "llm_documents",
    *(p.documents for p in ENCODERS),
    "devices_per_host",
)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh. Axis sizes multiply to the device count; -1 takes the remaining devices."""

    data: int = -1  # pure data parallelism (replicated params); slowest axis, spans hosts
    stage: int = 1  # pipeline stages: the stacked layers split into stages (see `pipeline`)
    fsdp: int = 1  # data parallelism with params/optimizer state sharded over this axis
    # Context parallelism: an LLM row is split over this many devices (a context group, inside
    # a host), batch.llm_row_len tokens each, keys and values gathered over the group; the
    # encoders see its devices as more data-parallel ones. 1 = off.
    context: int = 1
    tensor: int = 1  # tensor parallelism (heads, MLP width, vocab); fastest axis
    cpu_devices: int = 0  # split CPU-only hosts into this many devices, all processes; 0 = as is

    def __post_init__(self):
        check(
            isinstance(self.context, int) and self.context >= 1,
            "must be >= 1 (the devices one LLM row is split over; 1 = no context parallelism)",
            "context",
        )
        check(self.stage >= 1, "must be >= 1 (1: no pipeline); -1 is not allowed here", "stage")


SCHEDULES = ("auto", "gpipe", "1f1b")
PLACEMENTS = ("auto", "stages", "data")


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism (`mesh.stage` > 1): how layers and encoders are split into stages.

    Left on auto, a partitioner (jaxmllm/plan/stages/partition.py) chooses from the cost model,
    with the frozen modules' multipliers, and prints the plan at start-up.
    """

    schedule: str = "auto"  # gpipe | 1f1b | auto (the one with the least predicted step time)
    # Where each encoder (with its projector) runs: stages (its own pipeline stages, in front of
    # the LLM's) | data (data-parallel across the stage axis before the pipeline, each stage
    # encoding a share of the microbatches) | auto (the partitioner's choice)
    vision: str = "auto"
    audio: str = "auto"
    llm_layers: tuple[int, ...] = ()  # LLM layers per LLM stage, first to last; () = auto
    vision_layers: tuple[int, ...] = ()  # vision layers per vision stage (vision: stages)
    audio_layers: tuple[int, ...] = ()  # audio layers per audio stage (audio: stages)
    # Per-step variants: each encoder bucket may also run at these fractions of its capacity
    # (batch.vision_patches, audio_frames); 0 skips the encoder in a step without its modality.
    # One compiled program per variant used; the data thread picks each step's by predicted
    # time among those that hold the step.
    encoder_fractions: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        check(self.schedule in SCHEDULES, f"must be one of {', '.join(SCHEDULES)}", "schedule")
        for key in NAMES:
            check(getattr(self, key) in PLACEMENTS, f"must be one of {', '.join(PLACEMENTS)}", key)
        for key in ("llm_layers", *(f"{name}_layers" for name in NAMES)):
            value = getattr(self, key)
            check(
                isinstance(value, list | tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value),
                "must be a list of layer counts >= 1, one per stage (or [] for auto)",
                key,
            )
            object.__setattr__(self, key, tuple(value))
        fractions = self.encoder_fractions
        check(
            isinstance(fractions, list | tuple)
            and 1.0 in fractions
            and all(isinstance(f, int | float) and 0 <= f <= 1 for f in fractions),
            "must be a list of fractions in [0, 1] that holds 1 (the full bucket)",
            "encoder_fractions",
        )
        object.__setattr__(self, "encoder_fractions", tuple(sorted({float(f) for f in fractions})))

    def placement(self, phase: str) -> str:
        """Where an encoder phase runs: pipeline.<phase> (stages | data | auto)."""
        return getattr(self, phase)

    def layers(self, phase: str) -> tuple[int, ...]:
        """Layers per stage of a stack: pipeline.<phase>_layers (the LLM's or an encoder's)."""
        return getattr(self, f"{phase}_layers")


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
    planner: str = "orchestrated"  # one of PLANNER_NAMES (jaxmllm.plan.registry): orchestrated |
    # balanced | grain | naive | first_fit
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
            check(getattr(self, key) >= 1, "must be >= 1", key)
        for p in ENCODERS:
            check(p.bucket(self) % 4 == 0, "must be a multiple of 4", p.capacity)
        check(self.planner in PLANNER_NAMES, f"must be one of {sorted(PLANNER_NAMES)}", "planner")
        check(self.capacity in ("fixed", "auto"), "must be fixed or auto", "capacity")
        check(self.exchange in ("dense", "ragged"), "must be dense or ragged", "exchange")
        check(self.route_pair_capacity >= -1, "must be >= 0, or -1", "route_pair_capacity")
        check(self.attention_block >= 1, "must be >= 1", "attention_block")
        for key in AUTO_SIZES[1:]:  # (route_pair_capacity may also be 0)
            check(getattr(self, key) >= 1 or getattr(self, key) == -1, "must be >= 1, or -1 "
                   "for auto (resolved at start-up)", key)  # fmt: skip
        check(
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
    text_tokens: int = 0  # > 0: every text-only sample a counting run of exactly this many
    # tokens instead (long documents, e.g. for mesh.context); 0 = up to max_text_words words

    def __post_init__(self):
        check(self.text_tokens == 0 or self.text_tokens >= 3, "must be 0, or >= 3 (BOS and EOS "
              "around the text)", "text_tokens")  # fmt: skip


# data.format's values (`jaxmllm.data.records.formats` reads each; a test holds the two equal)
FORMATS = ("auto", "jsonl", "llava", "sharegpt", "messages", "parquet", "webdataset", "arrayrecord")


@dataclass(frozen=True)
class SourceConfig:
    """One data set of a mixture (`data.sources`)."""

    path: str = ""  # a data file, a directory of shards or a glob, as data.path
    format: str = "auto"  # as data.format
    # Its share of the samples drawn (the weights are normalised over the sources); 0 = in
    # proportion to its records (all sources 0: each record once per round, as one data set)
    weight: float = 0.0
    media_root: str = ""  # as data.media_root
    index_dir: str = ""  # its lengths index, as data.index_dir
    name: str = ""  # its name in the metrics (samples/<name>); "" = the file's (folder's) stem

    def __post_init__(self):
        check(bool(self.path), "every source needs a path", "path")
        check(self.format in FORMATS, f"must be one of {', '.join(FORMATS)}", "format")
        check(self.weight >= 0, "must be >= 0 (0: in proportion to its records)", "weight")


@dataclass(frozen=True)
class EvalConfig:
    """A fixed held-out set, evaluated every train.eval_every steps and at the last step: loss
    and token accuracy per modality mix, and greedy answers to its first questions."""

    # none | synthetic (the built-in source's samples num_samples, num_samples + 1, ...: made
    # like the training samples, never in the training index) | files (data.eval.path in
    # data.eval.format, with its own lengths index, as data.path) | jsonl | arrayrecord (files
    # in that format)
    source: str = "none"
    path: str = ""  # the eval data: a file, a directory of shards or a glob (as data.path)
    format: str = "auto"  # its format, as data.format
    index_dir: str = ""  # its lengths index; "" = <path>.index/<key>, as data.index_dir
    samples: int = 256  # the eval set: the source's first this many samples (0: all)
    questions: int = 8  # eval samples with a prompt answered greedily and logged; 0 = none
    max_new_tokens: int = 48  # the longest answer generated

    def __post_init__(self):
        check(self.source in ("none", *DATA_SOURCES), f"must be none or one of "
              f"{sorted(DATA_SOURCES)}", "source")  # fmt: skip
        check(
            self.source in ("none", "synthetic") or bool(self.path),
            f"source {self.source} needs data.eval.path (a data file, a directory or a glob)",
            "path",
        )
        check(self.format in FORMATS, f"must be one of {', '.join(FORMATS)}", "format")
        check(self.samples >= 0, "must be >= 0 (0: the whole source)", "samples")
        check(self.questions >= 0, "must be >= 0", "questions")
        check(self.max_new_tokens >= 1, "must be >= 1", "max_new_tokens")
        check(self.source != "synthetic" or self.samples > 0, "a synthetic eval set needs its "
              "size (> 0)", "samples")  # fmt: skip


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from, how they are preprocessed, and what happens to bad input."""

    # auto: files when data.path or data.sources is set, else synthetic | synthetic (built in)
    # | files (data.path or data.sources, read in data.format) | jsonl | arrayrecord (files in
    # that format: the names before data.format)
    source: str = "auto"
    # The data: a file, a directory of shards (its files of one format) or a glob
    # (data/train-*.parquet); or data.sources for a mixture
    path: str = ""
    # How the records are stored: auto (from the file: it says what it found and why) | jsonl
    # (jaxmllm's records, a JSON object a line) | llava, sharegpt (`conversations` of
    # `from`/`value` turns and an `image`; a JSON list or JSON lines) | messages (OpenAI-style
    # `messages`, media in content parts or lists) | parquet (as HF datasets writes it) |
    # webdataset (.tar shards: 000123.jpg + 000123.json or .txt) | arrayrecord
    format: str = "auto"
    # The folder media paths in the records are relative to (LLaVA's --image_folder); "" = the
    # data file's folder (a directory of shards: that directory)
    media_root: str = ""
    # A mixture: several data sets, each {path, format, weight, media_root, index_dir, name},
    # drawn by weight into one stream the planner balances as one (instead of data.path)
    sources: tuple[SourceConfig, ...] = ()
    # `python -m jaxmllm.data.index` fails (and training refuses the index) when it accepts
    # less than this share of the records: a wrong data.format rejects them all
    min_accept: float = 0.5
    # lengths index from `python -m jaxmllm.data.index`; "" = <path>.index/<key>, the key naming
    # what decides its counts (tokenizer, preprocessing), so configs that differ keep their own
    index_dir: str = ""
    # byte (UTF-8 bytes + jaxmllm's 8 specials); the path of a tokenizer.json file (training from
    # scratch: its ids >= 256 shifted by 8 past jaxmllm's specials); or the path of a HuggingFace
    # checkpoint's tokenizer directory (tokenizer.json + tokenizer_config.json: the checkpoint's
    # own ids, special tokens and chat template, for fine-tuning it). Nothing is downloaded.
    tokenizer: str = "byte"
    # The date a tokenizer directory's chat template writes where it asks for today's
    # (strftime_now, e.g. Llama 3.2's "Today Date:"), fixed so token counts do not change daily.
    template_date: str = "2024-07-26"
    image_min_pixels: int = 3136  # smaller images are upscaled to about this many pixels
    image_max_pixels: int = 1003520  # larger images are downscaled to at most this many pixels
    # Pixels become (x / 255 - mean) / std per channel (RGB): 0.5 / 0.5 maps them to [-1, 1]
    # (SigLIP's); a pretrained encoder wants its processor's (`hf import` copies them)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # Log-mel features: jaxmllm (HTK mel, its own framing) | whisper (exactly Whisper's
    # feature extractor: Slaney mel, centred 400-sample frames; what a Whisper encoder saw)
    mel: str = "jaxmllm"
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
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (none by default)

    def __post_init__(self):
        check(self.source in ("auto", *DATA_SOURCES), f"must be auto or one of "
              f"{sorted(DATA_SOURCES)}", "source")  # fmt: skip
        check(self.format in FORMATS, f"must be one of {', '.join(FORMATS)}", "format")
        check(not (self.path and self.sources), "give data.path (one data set) or data.sources "
              "(a mixture), not both", "sources")  # fmt: skip
        if self.source == "auto":  # (resolved once, here)
            given = bool(self.path or self.sources)
            object.__setattr__(self, "source", "files" if given else "synthetic")
        check(
            self.source == "synthetic" or bool(self.path or self.sources),
            f"source {self.source} needs data.path (a data file, a directory of shards or a "
            "glob) or data.sources",
            "path",
        )
        check(
            self.source not in ("jsonl", "arrayrecord") or self.format in ("auto", self.source),
            f"{self.format} contradicts data.source: {self.source}; set data.source: files",
            "format",
        )
        check(0.0 <= self.min_accept <= 1.0, "must be in [0, 1]", "min_accept")
        object.__setattr__(self, "sources", tuple(self.sources))
        given = [s.weight > 0 for s in self.sources]
        check(all(given) or not any(given), "give every source a weight > 0, or none (all 0: "
              "each in proportion to its records)", "sources")  # fmt: skip
        check(self.on_error in ("skip", "fail"), "must be skip or fail", "on_error")
        check(
            self.on_oversize in ("shrink", "truncate", "skip", "fail"),
            "must be shrink, truncate, skip or fail",
            "on_oversize",
        )
        check(self.image_min_pixels >= 1, "must be >= 1", "image_min_pixels")
        check(min(self.image_std) > 0, "every channel's std must be > 0", "image_std")
        check(self.mel in ("jaxmllm", "whisper"), "must be jaxmllm or whisper", "mel")
        check(
            self.image_max_pixels >= self.image_min_pixels,
            "must be >= image_min_pixels",
            "image_max_pixels",
        )
        check(self.audio_sample_rate >= 1000, "must be >= 1000 Hz", "audio_sample_rate")
        check(
            self.audio_max_frames >= 4 and self.audio_max_frames % 4 == 0,
            "must be a positive multiple of 4 (the audio encoder's subsampling)",
            "audio_max_frames",
        )
        check(self.max_image_pixels >= 1, "must be >= 1", "max_image_pixels")
        check(self.max_audio_seconds > 0, "must be > 0", "max_audio_seconds")
        check(self.workers >= 0, "must be >= 0", "workers")
        check(_is_date(self.template_date), "must be a date, YYYY-MM-DD", "template_date")


DATA_SOURCES = {"synthetic", "files", "jsonl", "arrayrecord"}


def files_format(data: DataConfig | EvalConfig) -> str:
    """The data.format a files source reads: data.format, or what data.source names."""
    return data.source if data.source in ("jsonl", "arrayrecord") else data.format


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
    # Evaluate on data.eval every N steps and at the last step (0: at the last step only);
    # nothing without data.eval.source
    eval_every: int = 0

    def __post_init__(self):
        positive(self, "steps", "log_every", "checkpoint_every", "keep_checkpoints")
        check(self.eval_every >= 0, "must be >= 0 (0: at the last step only)", "eval_every")
        check(self.max_nonfinite_steps >= 0, "must be >= 0 (0 = never stop)", "max_nonfinite_steps")


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
        positive(self, "init_timeout_s", "heartbeat_timeout_s", "step_timeout_s")
        check(
            self.num_processes == -1 or self.num_processes >= 1,
            "must be >= 1, or -1 (from the environment)",
            "num_processes",
        )
        check(self.process_id >= -1, "must be >= 0, or -1 (from the environment)", "process_id")
        check(
            not self.coordinator or ":" in self.coordinator,
            f"{self.coordinator!r} must be host:port",
            "coordinator",
        )


def _is_date(text: str) -> bool:
    try:
        datetime.strptime(text, "%Y-%m-%d")
    except (TypeError, ValueError):
        return False
    return True
