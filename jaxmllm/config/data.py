"""The data section: where samples come from (data.path in data.format, or a mixture of
data.sources; data.eval's held-out set), how they are preprocessed, and what happens to bad
input."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from jaxmllm.config.checks import check

MELS = ("jaxmllm", "whisper", "gemma4")  # data.mel (jaxmllm.data.media.audio.LOG_MELS)
BYTE_VOCAB = 264  # the byte tokenizer's ids: 256 bytes, then jaxmllm's 8 reserved specials


@dataclass(frozen=True)
class SyntheticConfig:
    """Built-in learnable data: shapes with captions, tones with captions, text patterns."""

    num_samples: int = 4096  # samples per epoch
    image_fraction: float = 0.4  # share of samples with one or more images
    multi_image_fraction: float = 0.1  # share with two images
    audio_fraction: float = 0.25  # share with an audio clip
    # share with a video (model.vision.video): a coloured shape moving left or right across
    # its frames, asked "which way does it move?"
    video_fraction: float = 0.0
    min_video_frames: int = 4  # frames of a video (whole temporal patches are used)
    max_video_frames: int = 8
    video_side: int = 8  # a frame's side in patches (a multiple of model.vision.merge)
    min_image_side: int = 4  # image side in patches (even numbers are used)
    max_image_side: int = 16  # largest image side in patches
    min_audio_frames: int = 16  # shortest clip in log-mel frames
    max_audio_frames: int = 128  # longest clip in log-mel frames
    max_text_words: int = 24  # longest text-only sample in words
    text_tokens: int = 0  # > 0: every text-only sample a counting run of exactly this many
    # tokens instead (long documents, e.g. for mesh.context); 0 = up to max_text_words words

    def __post_init__(self):
        check(
            self.text_tokens == 0 or self.text_tokens >= 3,
            "must be 0, or >= 3 (BOS and EOS around the text)",
            "text_tokens",
        )
        check(
            self.image_fraction + self.audio_fraction + self.video_fraction <= 1,
            "image, audio and video fractions must add up to at most 1",
            "video_fraction",
        )
        check(
            1 <= self.min_video_frames <= self.max_video_frames,
            "must be >= 1 and <= max_video_frames",
            "min_video_frames",
        )
        check(self.video_side >= 1, "must be >= 1", "video_side")


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
    confine_media_to: str = ""  # as data.confine_media_to
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
    # Each question also answered this many times by sampling at `temperature`: how often a
    # sample is right (eval/answers/<score>/mean@n) and whether one of them is (best@n,
    # pass@n) beside the greedy answer's score; what online RL can learn from (docs/rl.md)
    sampled_answers: int = 0
    temperature: float = 1.0  # the sampled answers' (not the greedy one's)

    def __post_init__(self):
        check(
            self.source in ("none", *DATA_SOURCES),
            f"must be none or one of {sorted(DATA_SOURCES)}",
            "source",
        )
        check(
            self.source in ("none", "synthetic") or bool(self.path),
            f"source {self.source} needs data.eval.path (a data file, a directory or a glob)",
            "path",
        )
        check(self.format in FORMATS, f"must be one of {', '.join(FORMATS)}", "format")
        check(self.samples >= 0, "must be >= 0 (0: the whole source)", "samples")
        check(self.questions >= 0, "must be >= 0", "questions")
        check(self.max_new_tokens >= 1, "must be >= 1", "max_new_tokens")
        check(
            self.sampled_answers >= 0,
            "must be >= 0 (0: the greedy answer alone)",
            "sampled_answers",
        )
        check(
            not self.sampled_answers or self.questions > 0,
            "samples answers to data.eval.questions, which is 0: set it too",
            "sampled_answers",
        )
        check(
            self.temperature > 0, "must be > 0 (the greedy answer is always given)", "temperature"
        )
        check(
            self.source != "synthetic" or self.samples > 0,
            "a synthetic eval set needs its size (> 0)",
            "samples",
        )


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from, how they are preprocessed, and what happens to bad input."""

    # Where samples come from: files (data.path or data.sources, read in data.format) |
    # synthetic (the built-in shapes, moving shapes, tones and counting text: only when asked
    # for) | none (no data: generation, the memory bench; training refuses to start) | auto
    # (files when data.path or data.sources is set, else none) | jsonl, arrayrecord (files in
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
    # The folder relative media paths in the records start from (LLaVA's --image_folder); "" =
    # the data file's folder (a directory of shards: that directory; data.eval.path's for its
    # records)
    media_root: str = ""
    # The folder media paths must lead inside once "..", absolute paths and symlinks are
    # resolved (else the record is rejected: path_outside_root); "" = the folder they start
    # from. A parent of it lets records reach a sibling folder ("../images/0.png") while
    # relative paths keep their start; it must hold data.media_root (or the data's folder)
    confine_media_to: str = ""
    # A mixture: several data sets, each {path, format, weight, media_root, index_dir, name},
    # drawn by weight into one stream the planner balances as one (instead of data.path)
    sources: tuple[SourceConfig, ...] = ()
    # `python -m jaxmllm.data.index` fails (and training refuses the index) when it accepts
    # less than this share of the records: a wrong data.format rejects them all
    min_accept: float = 0.5
    # lengths index from `python -m jaxmllm.data.index`; "" = <path>.index/<key>, the key naming
    # what decides its counts (tokenizer, preprocessing), so configs that differ keep their own
    index_dir: str = ""
    # Where `python -m jaxmllm.data.index` runs its shards: "" = local worker processes
    # (--workers); auto = Ray tasks on the cluster `ray start` started on this machine (or
    # RAY_ADDRESS), else a local Ray; or a Ray cluster's address (host:6379). Needs the ray
    # extra (pip install -e '.[ray]'); --ray on the command line overrides it.
    index_ray: str = ""
    # byte (UTF-8 bytes + jaxmllm's 8 specials); the path of a tokenizer.json file (training from
    # scratch: its ids >= 256 shifted by 8 past jaxmllm's specials); or the path of a HuggingFace
    # checkpoint's tokenizer directory (tokenizer.json + tokenizer_config.json: the checkpoint's
    # own ids, special tokens and chat template, for fine-tuning it). Nothing is downloaded.
    tokenizer: str = "byte"
    # The date a tokenizer directory's chat template writes where it asks for today's
    # (strftime_now, e.g. Llama 3.2's "Today Date:"), fixed so token counts do not change daily.
    template_date: str = "2024-07-26"
    # The largest tokenizer.json a tokenizer directory may hold (bytes; each process holds it
    # parsed, about 20x the file; the largest released ones, Gemma 3's, are ~33 MB)
    max_tokenizer_bytes: int = 48 << 20
    image_min_pixels: int = 3136  # smaller images are upscaled to about this many pixels
    image_max_pixels: int = 1003520  # larger images are downscaled to at most this many pixels
    # How an image's sides become whole merge blocks: round (each side rounded, then scaled
    # into [image_min_pixels, image_max_pixels]: Qwen2-VL's) | floor (scaled to
    # image_max_pixels at its aspect ratio, up or down, each side floored: Gemma 4's processor;
    # image_min_pixels is not read)
    image_resize: str = "round"
    # Pixels become (x / 255 - mean) / std per channel (RGB): 0.5 / 0.5 maps them to [-1, 1]
    # (SigLIP's); a pretrained encoder wants its processor's (`hf import` copies them)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # Log-mel features: jaxmllm (HTK mel, its own framing) | whisper (exactly Whisper's
    # feature extractor: Slaney mel, centred 400-sample frames; what a Whisper encoder saw) |
    # gemma4 (Gemma4AudioFeatureExtractor's: 20 ms frames, magnitude, log(mel + 1e-3); a
    # clip's last LLM token takes its last frames, ceil(frames / 4) tokens, as its processor)
    mel: str = "jaxmllm"
    audio_sample_rate: int = 16000  # clips are resampled to this rate (Hz); 10 ms mel hop
    audio_max_frames: int = 3000  # longest clip in log-mel frames; longer clips become chunks
    # Decompression-bomb caps, checked on the file header before any pixel or sample is decoded
    # (index and loader alike); a file over a cap is rejected (image_too_large, audio_too_long).
    max_image_pixels: int = 1 << 26  # width x height of a stored image (64 Mpx = 8192 x 8192)
    # Scans of a progressive JPEG, counted from its markers before decoding: each scan is a
    # pass over the whole image, so a few KB of repeated scans cost minutes (libjpeg-turbo's
    # LJT-01-003); encoders write at most about a dozen. Over it: image_too_costly
    max_image_scans: int = 100
    # ... and scans x width x height of one (each scan a pass over every pixel): the decoding
    # time of its scans, whatever its size (12 scans of 64 Mpx pass; 100 of 16 Mpx do not).
    # Over it: image_too_costly
    max_image_scan_pixels: int = 1 << 30
    max_audio_seconds: float = 600.0  # length of a clip from its header (frames / rate)
    # Samples of a stored clip over all its channels (frames x channels), from its header: what
    # decoding it costs whatever its rate (600 s of 48 kHz stereo: 57.6 M); over it: audio_too_long
    max_audio_samples: int = 1 << 26
    # Bytes of a media file (or inline media, or a manifest line), from its size before any
    # byte is read; over it: media_too_large (a line: malformed_line)
    max_media_bytes: int = 1 << 30
    # Bytes of memory a process reading records may spend on one (decoding an image or a clip,
    # parsing a JSON line, a Parquet row group), estimated before it is read; over it: a
    # counted reject, over_memory_budget. 0 = half the machine's (or its cgroup's) memory
    # shared by the processes reading side by side (data.workers, an index's --workers), at
    # least 256 MiB
    worker_memory: int = 0
    # true: media paths may lead anywhere (absolute paths kept on purpose); they are still read
    # only as regular files, within the caps above
    allow_outside_paths: bool = False
    # Videos (records' `videos`, model.vision.video): frames sampled at video_fps a second, at
    # least video_min_frames, at most video_max_frames and the video's own, rounded down to
    # whole temporal patches (model.vision.temporal_patch); each frame resized within
    # min(video_frame_max_pixels, video_max_pixels x temporal_patch / frames) pixels (a video's
    # budget split over its frames, as Qwen2-VL's video processor does; at least 1.05 x
    # video_frame_min_pixels) on the patch x merge grid. A video is then about
    # video_max_pixels / (patch x merge)^2 LLM tokens, however long (Qwen2-VL's processor:
    # 100352 / 602112 / 90316800 pixels, 2 fps, 4 to 768 frames)
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_frame_min_pixels: int = 3136
    video_frame_max_pixels: int = 602112
    video_max_pixels: int = 3211264  # 4096 LLM tokens of 28 x 28 pixels
    # Each temporal patch of a video preceded by its time as text, `<1.5 seconds>` (the mean
    # of its first and last sampled frames' times), and wrapped in the tokenizer's vision
    # start and end tokens where it has them, as Qwen3-VL's processor writes a video; M-RoPE
    # then places each temporal patch as an image of its own (`hf import` of a Qwen3-VL sets it)
    video_timestamps: bool = False
    # Video caps, checked on the container's header before any frame is decoded (index and
    # loader alike): its length, and its frames x width x height (the most decoding can
    # produce: 2^38 is 75 minutes of 1080p at 30 fps); a stored frame is also held to
    # max_image_pixels. Over a cap: rejected (video_too_large).
    max_video_seconds: float = 3600.0
    max_video_decoded_pixels: int = 1 << 38
    on_error: str = "skip"  # bad or missing media, bad lines, placeholder mismatch: skip | fail
    # The share of the samples a run draws that may fail to load (media deleted, changed or
    # out of reach since the index was built: each a counted load-time reject, its slots
    # padding) before the run stops, exit 2, naming the commonest reason: media missing on
    # this host (an index built on another machine) fail them all. Judged over the run so far
    # and all its processes once 32 samples are drawn (several processes: at logged steps),
    # and at its last step; 1 = never stop
    max_load_rejects: float = 0.1
    on_oversize: str = "shrink"  # a sample no bucket can hold: shrink | truncate | skip | fail
    workers: int = 0  # preprocessing worker processes; 0 = in the training process
    # Read videos' sampled, resized frames from the data set's frame cache (`python -m
    # jaxmllm.data.frames --config X` builds it once, beside the index, under the same
    # preprocessing key: lossless uint8, checksummed) instead of decoding them; a video the
    # cache lacks, or whose entry is stale or damaged, is decoded, counted (frames/ metrics)
    frame_cache: bool = False
    # Steps the feed's thread prepares ahead of the trainer (planned, loaded, on the devices:
    # each holds a batch's device memory); evens out uneven steps. 0 = none (no thread).
    prefetch: int = 2
    seed: int = 0  # shuffling and generation seed
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (none by default)

    def __post_init__(self):
        check(
            self.source in ("auto", "none", *DATA_SOURCES),
            f"must be auto, none or one of {sorted(DATA_SOURCES)}",
            "source",
        )
        check(self.format in FORMATS, f"must be one of {', '.join(FORMATS)}", "format")
        check(self.worker_memory >= 0, "must be >= 0 bytes (0: auto)", "worker_memory")
        check(
            0 <= self.max_load_rejects <= 1,
            "must be a share from 0 to 1 (1: never stop)",
            "max_load_rejects",
        )
        check(
            not (self.path and self.sources),
            "give data.path (one data set) or data.sources (a mixture), not both",
            "sources",
        )
        if self.source == "auto":  # (resolved once, here: the built-in data only when named)
            given = bool(self.path or self.sources)
            object.__setattr__(self, "source", "files" if given else "none")
        check(  # (a copy of a synthetic config given a data.path must not train on shapes)
            self.source != "synthetic" or not (self.path or self.sources),
            "synthetic reads the built-in data, not data.path / data.sources: set data.source: "
            "files (or auto) to read them, or drop them",
            "source",
        )
        check(
            self.source in ("synthetic", "none") or bool(self.path or self.sources),
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
        check(
            all(given) or not any(given),
            "give every source a weight > 0, or none (all 0: each in proportion to its records)",
            "sources",
        )
        check(self.on_error in ("skip", "fail"), "must be skip or fail", "on_error")
        check(
            self.on_oversize in ("shrink", "truncate", "skip", "fail"),
            "must be shrink, truncate, skip or fail",
            "on_oversize",
        )
        check(self.image_min_pixels >= 1, "must be >= 1", "image_min_pixels")
        check(min(self.image_std) > 0, "every channel's std must be > 0", "image_std")
        check(self.mel in MELS, f"must be one of {', '.join(MELS)}", "mel")
        check(self.image_resize in ("round", "floor"), "must be round or floor", "image_resize")
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
        check(
            self.image_min_pixels <= self.max_image_pixels,
            f"must be <= data.max_image_pixels={self.max_image_pixels}: every image is upscaled "
            "to at least this many pixels, more than the largest image decoded (a preprocessor "
            "config's min_pixels in another unit?)",
            "image_min_pixels",
        )
        check(self.max_image_scans >= 1, "must be >= 1", "max_image_scans")
        check(self.max_tokenizer_bytes >= 1, "must be >= 1", "max_tokenizer_bytes")
        check(self.max_image_scan_pixels >= 1, "must be >= 1", "max_image_scan_pixels")
        check(self.max_audio_seconds > 0, "must be > 0", "max_audio_seconds")
        check(self.max_audio_samples >= 1, "must be >= 1", "max_audio_samples")
        check(self.max_media_bytes >= 1, "must be >= 1", "max_media_bytes")
        check(self.video_fps > 0, "must be > 0 (frames sampled a second)", "video_fps")
        check(self.video_min_frames >= 1, "must be >= 1", "video_min_frames")
        check(
            self.video_max_frames >= self.video_min_frames,
            "must be >= video_min_frames",
            "video_max_frames",
        )
        check(self.video_frame_min_pixels >= 1, "must be >= 1", "video_frame_min_pixels")
        check(
            self.video_frame_max_pixels >= self.video_frame_min_pixels,
            "must be >= video_frame_min_pixels",
            "video_frame_max_pixels",
        )
        check(self.video_max_pixels >= 1, "must be >= 1", "video_max_pixels")
        check(self.max_video_seconds > 0, "must be > 0", "max_video_seconds")
        check(self.max_video_decoded_pixels >= 1, "must be >= 1", "max_video_decoded_pixels")
        check(self.workers >= 0, "must be >= 0", "workers")
        check(self.prefetch >= 0, "must be >= 0 (0: no thread)", "prefetch")
        check(_is_date(self.template_date), "must be a date, YYYY-MM-DD", "template_date")


DATA_SOURCES = {"synthetic", "files", "jsonl", "arrayrecord"}


def no_data(config: str = "<your config>") -> str:
    """What a command that needs data says to a config that names none (data.source: none,
    or auto without data.path and data.sources)."""
    return (
        "the config names no data: set data.path (a data file, a folder of shards or a glob, "
        "in any data.format; then index it once: python -m jaxmllm.data.index --config "
        f"{config}), data.sources (a mixture of data sets), or data.source: synthetic (the "
        "built-in shapes, tones and counting text)"
    )


def files_format(data: DataConfig | EvalConfig) -> str:
    """The data.format a files source reads: data.format, or what data.source's old names
    meant (jaxmllm's records: an .array_record file by its suffix, else JSON lines)."""
    if data.source in ("jsonl", "arrayrecord"):
        return "arrayrecord" if str(data.path).endswith(".array_record") else "jsonl"
    return data.format


def _is_date(text: str) -> bool:
    try:
        datetime.strptime(text, "%Y-%m-%d")
    except (TypeError, ValueError):
        return False
    return True
