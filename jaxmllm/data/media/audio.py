"""Audio: header lengths, decoding to mono, resampling, log-mel frames, chunking (numpy only).

Frames are 25 ms Hann windows every 10 ms at the target rate, so a clip of n samples at rate sr
has `clip_frames(n, sr, ...)` frames: the index computes that from the header, preprocessing
from the decoded clip, with the same function.

Decoding cost is bounded before a sample is decoded, from the header: its length
(data.max_audio_seconds), its samples over all channels whatever the rate
(data.max_audio_samples: a 590 s FLAC at 655 kHz is 386 M samples) and its file size
(data.max_media_bytes). Decoding then holds one block of samples at the source rate at a time:
each is mixed to mono and resampled as it comes (`Resampler`), so memory follows the clip at
the target rate, not the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxmllm.config import UserError
from jaxmllm.data import budget
from jaxmllm.data.rejects import MAX_MEDIA_BYTES, RecordError, check_media_file

if TYPE_CHECKING:
    import soundfile

Source = str | Path | bytes
HOP_S, WIN_S = 0.010, 0.025
GEMMA4 = "gemma4"  # data.mel's value for Gemma 4's features (Gemma4AudioFeatureExtractor)
FRAME_S = 0.020  # Gemma 4's frames (Gemma4AudioFeatureExtractor's frame_length_ms)
GEMMA4_MEL_FLOOR = 1e-3  # its mel_floor
GEMMA4_MAX_HZ = 8000.0  # its max_frequency
MAX_SECONDS = 600.0  # the default of data.max_audio_seconds
MAX_SAMPLES = 1 << 26  # the default of data.max_audio_samples (frames x channels)
MAX_RATE = 768_000  # Hz; above any real recording: a header saying more is broken or hostile
BLOCK_SAMPLES = 1 << 18  # samples (frames x channels) decoded at a time
TAPS = 31  # the low-pass filter's half width (63 taps)


def clip_frames(
    num_samples: int, sample_rate: int, target_rate: int, subsample: int, framing: str = "hop"
) -> int:
    """Log-mel frames of a clip after resampling: `framing` hop (one a hop, rounded down to a
    multiple of `subsample`) | gemma4 (Gemma 4's `valid_frames`, rounded up to a multiple of
    `subsample`: its last LLM token takes the clip's last frames, the rest padding, as
    Gemma4Processor counts ceil(frames / 4) soft tokens)."""
    if framing == GEMMA4:
        valid = valid_frames(num_samples, sample_rate, target_rate)
        return -(-valid // subsample) * subsample
    frames = resampled_length(num_samples, sample_rate, target_rate) // hop_length(target_rate)
    return frames - frames % subsample


def valid_frames(num_samples: int, sample_rate: int, target_rate: int) -> int:
    """Gemma 4's log-mel frames of a clip after resampling (Gemma4AudioFeatureExtractor's
    valid ones): frames of FRAME_S every hop, the first centred at the clip's start, each
    wholly inside the clip."""
    n = resampled_length(num_samples, sample_rate, target_rate)
    frame = round(target_rate * FRAME_S)
    return max(0, (n + frame // 2 - (frame + 1)) // hop_length(target_rate) + 1)


def framing(mel: str) -> str:
    """How a clip's frames are counted under data.mel `mel` (`clip_frames`' framing)."""
    return GEMMA4 if mel == GEMMA4 else "hop"


def chunk_lengths(frames: int, max_frames: int) -> list[int]:
    """Cuts `frames` into chunks of at most `max_frames` (the last one shorter)."""
    full, rest = divmod(frames, max_frames)
    return [max_frames] * full + ([rest] if rest else [])


def chunk_positions(lengths: list[int], valid: int) -> list[np.ndarray]:
    """Each chunk's frames' positions (its frame index, int32), -1 past the clip's first
    `valid` frames: the frames that pad its last LLM token, which the encoder masks."""
    out, start = [], 0
    for n in lengths:
        index = np.arange(n, dtype=np.int32)
        out.append(np.where(start + index < valid, index, -1).astype(np.int32))
        start += n
    return out


def resampled_length(num_samples: int, sample_rate: int, target_rate: int) -> int:
    """Samples a clip of `num_samples` at `sample_rate` has at `target_rate` (rounded down)."""
    return num_samples * target_rate // sample_rate


def hop_length(rate: int) -> int:
    """Samples between log-mel frames at `rate` Hz (HOP_S seconds)."""
    return round(rate * HOP_S)


@dataclasses.dataclass(frozen=True)
class Caps:
    """What a clip may cost before it is decoded (data.max_audio_seconds, max_audio_samples,
    max_media_bytes)."""

    seconds: float = MAX_SECONDS
    samples: int = MAX_SAMPLES
    bytes: int = MAX_MEDIA_BYTES
    memory: int = 0  # data.worker_memory (0: none): a clip's cost is `decode_bytes`
    target_rate: int = 16000  # data.audio_sample_rate: the rate clips are resampled to (Hz)


def read_info(
    src: Source, record_id: str = "?", max_seconds: float = MAX_SECONDS, caps: Caps | None = None
) -> tuple[int, int]:
    """(samples per channel, sample rate) from the header, without decoding.

    Refuses a clip over the caps (`caps`, else the defaults with `max_seconds`) and implausible
    headers before any sample is read.
    """
    caps = caps or Caps(seconds=max_seconds)
    check_media_file(src, record_id, caps.bytes)
    sf = _soundfile()
    try:
        info = sf.info(_file(src))
    except Exception as e:  # noqa: BLE001  libsndfile's errors on hostile bytes; see _blocks
        raise RecordError("undecodable_media", _what(src, e), record_id) from None
    _check_header(src, info.frames, info.samplerate, info.channels, caps, record_id)
    return int(info.frames), int(info.samplerate)


@contextlib.contextmanager
def open_mono(src: Source, record_id: str, caps: Caps):
    """(frames, rate, blocks) of a clip whose header passed the caps: `blocks` yields float32
    mono (the mean of the channels) a block at a time, at most `frames` in all, so memory holds
    one block whatever the length and channel count; any decoder error, or a NaN / inf
    sample, is a RecordError (undecodable_media)."""
    check_media_file(src, record_id, caps.bytes)
    sf = _soundfile()
    try:
        f = sf.SoundFile(_file(src))
    except Exception as e:  # noqa: BLE001  see _blocks
        raise RecordError("undecodable_media", _what(src, e), record_id) from None
    with f:
        frames, rate = f.frames, f.samplerate
        _check_header(src, frames, rate, f.channels, caps, record_id)
        yield int(frames), int(rate), _blocks(f, src, record_id)


def _blocks(f: soundfile.SoundFile, src: Source, record_id: str) -> Iterator[np.ndarray]:
    """The open file's samples as mono float32 blocks (channels averaged), read a block at a
    time so a long clip never sits in memory whole; refuses NaN and inf samples."""
    block = max(1, BLOCK_SAMPLES // f.channels)
    try:
        for x in f.blocks(block, dtype="float32", always_2d=True, frames=f.frames):
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf: rejected below
                mono = x.mean(axis=1, dtype=np.float32)
            if not np.isfinite(mono).all():  # float WAV/AIFF can store NaN and inf
                raise RecordError(
                    "undecodable_media", f"{_name(src)}: non-finite samples", record_id
                )
            yield mono
    except RecordError:
        raise
    # libsndfile (through soundfile's cffi layer) raises LibsndfileError, RuntimeError,
    # TypeError, ValueError, ... on hostile bytes; all mean this file cannot become samples.
    except Exception as e:  # noqa: BLE001
        raise RecordError("undecodable_media", _what(src, e), record_id) from None


def decode_mono(
    src: Source, record_id: str = "?", max_seconds: float = MAX_SECONDS, caps: Caps | None = None
) -> tuple[np.ndarray, int]:
    """Decodes to float32 mono (the mean of the channels) and returns (samples, rate), the
    header checked as `read_info` does."""
    with open_mono(src, record_id, caps or Caps(seconds=max_seconds)) as (_, rate, blocks):
        x = np.concatenate([np.zeros(0, np.float32), *blocks])
    return x, rate


def _check_header(src, frames, rate, channels, caps: Caps, record_id) -> None:
    """Refuses a clip from its header before a sample is read: empty, an implausible rate, or
    past the caps (its seconds, samples x channels, the memory decoding it takes)."""
    if frames <= 0 or rate <= 0 or channels <= 0:
        raise RecordError("undecodable_media", f"{_name(src)}: empty or unknown length", record_id)
    if rate > MAX_RATE:
        raise RecordError(
            "undecodable_media", f"{_name(src)}: implausible sample rate {rate} Hz", record_id
        )
    if frames > caps.seconds * rate:
        raise RecordError(
            "audio_too_long",
            f"{_name(src)}: {frames / rate:.1f} s > data.max_audio_seconds={caps.seconds}",
            record_id,
        )
    if frames * channels > caps.samples:
        raise RecordError(
            "audio_too_long",
            f"{_name(src)}: {frames} samples x {channels} channels at {rate} Hz > "
            f"data.max_audio_samples={caps.samples} (not decoded)",
            record_id,
        )
    what = f"{_name(src)}: decoding {frames} samples at {rate} Hz"
    budget.check(decode_bytes(frames, rate, caps.target_rate), caps.memory, what, record_id)


# Peak memory of decoding a clip, per sample of it resampled to data.audio_sample_rate: the
# source is read a block at a time (BLOCK_SAMPLES), so the peak follows the resampled clip and
# its log-mel (float64 windows and their complex spectrum). Measured as jaxmllm/data/budget.py
# measures the image path (a process's peak resident growth over one read), 300 s clips:
# 59 bytes a resampled sample at 8, 16, 44.1 (stereo) and 48 kHz sources alike.
BYTES_PER_RESAMPLED = 64


def decode_bytes(frames: int, rate: int, target_rate: int) -> int:
    """What decoding a clip of `frames` at `rate` Hz holds at its peak (bytes): its samples at
    `target_rate`, BYTES_PER_RESAMPLED each, and one source block of float32 beside them."""
    return BYTES_PER_RESAMPLED * resampled_length(frames, rate, target_rate) + 4 * min(
        frames, BLOCK_SAMPLES
    )


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited linear-interpolation resampling to `resampled_length` samples."""
    r = Resampler(rate, target)
    r.feed(np.asarray(x, np.float32))
    return r.finish(len(x))


class Resampler:
    """`resample` a block at a time: feed the clip's samples in order, then `finish(n)` with
    its length (zeros pad a clip that came out short); holds only what the next outputs need.

    Low-pass below the new Nyquist first when downsampling (a windowed sinc of 63 taps, zeros
    beyond the clip), then linear interpolation at output j's position j * rate / target; each
    output is computed from the same samples with the same arithmetic whatever the blocks, so
    the result is the whole clip's `np.convolve(mode="same")` and `np.interp`, to the bit.
    """

    def __init__(self, rate: int, target: int):
        """A streaming resampler from `rate` to `target` Hz: a windowed-sinc low-pass (Hamming,
        2 TAPS + 1 taps) where it downsamples, then linear interpolation."""
        self.rate, self.target, self.ratio = rate, target, rate / target
        self.taps = None
        if target < rate:
            cutoff = 0.5 * target / rate
            t = np.arange(-TAPS, TAPS + 1)
            taps = 2 * cutoff * np.sinc(2 * cutoff * t) * np.hamming(len(t))
            self.taps = taps / taps.sum()
        self.raw = np.zeros(TAPS if self.taps is not None else 0, np.float32)  # zeros before 0
        self.raw0 = -len(self.raw)  # the clip's index of raw[0]
        self.filtered = np.zeros(0, np.float64)
        self.f0 = 0  # the clip's index of filtered[0]
        self.out: list[np.ndarray] = []
        self.done = 0  # outputs made

    def feed(self, x: np.ndarray) -> None:
        """Takes the next block of samples: filters what its taps now reach and interpolates the
        outputs whose neighbours are both filtered."""
        if self.rate == self.target:
            self.out.append(x.astype(np.float32))
            return
        self.raw = np.concatenate([self.raw, x])
        self._filter(self.raw0 + len(self.raw) - (TAPS if self.taps is not None else 0))
        self._interp(final=False)

    def finish(self, n: int) -> np.ndarray:
        """The resampled clip of `n` samples: `resampled_length(n, rate, target)` outputs."""
        if self.rate == self.target:
            x = np.concatenate([np.zeros(0, np.float32), *self.out])
            return np.pad(x[:n], (0, max(0, n - len(x))))
        have = self.raw0 + len(self.raw)
        if have > n:  # (fed past n: trimmed, as the whole clip is cut to n)
            raise ValueError(f"fed {have} samples, finishing at {n}")
        pad = n - have + (TAPS if self.taps is not None else 0)
        self.raw = np.concatenate([self.raw, np.zeros(pad, np.float32)])
        self.n = n
        self._filter(n)
        self._interp(final=True)
        return np.concatenate([np.zeros(0, np.float32), *self.out])

    def _filter(self, upto: int) -> None:
        """Filtered samples up to (not incl.) clip index `upto`, from the raw ones held."""
        start = self.f0 + len(self.filtered)
        if upto <= start:
            return
        if self.taps is None:  # upsampling: interpolated as they are
            part = self.raw[start - self.raw0 : upto - self.raw0].astype(np.float64)
        else:  # y[i] = sum x[i-31 .. i+31] * taps (np.convolve's "same", zeros beyond the clip)
            window = self.raw[start - TAPS - self.raw0 : upto + TAPS - self.raw0]
            part = np.convolve(window, self.taps, mode="valid")
        self.filtered = np.concatenate([self.filtered, part])
        keep = upto - TAPS - self.raw0 if self.taps is not None else upto - self.raw0
        self.raw, self.raw0 = self.raw[keep:], self.raw0 + keep

    def _interp(self, final: bool) -> None:
        """Linearly interpolates the outputs the filtered samples reach (`final`: every output of
        the clip's length, the last ones against the end)."""
        last = self.f0 + len(self.filtered) - 1  # the newest filtered sample
        if final:
            n_out = resampled_length(self.n, self.rate, self.target)
        else:  # outputs whose two neighbours are both here (position < last), and that the
            # clip has whatever its final length (at least the samples fed so far)
            fed = resampled_length(self.raw0 + len(self.raw), self.rate, self.target)
            n_out = min(fed, int(np.ceil(last / self.ratio))) if last > 0 else 0
            while n_out > self.done and (n_out - 1) * self.ratio >= last:
                n_out -= 1
        if n_out <= self.done:
            return
        pos = np.arange(self.done, n_out) * self.ratio
        xp = np.arange(self.f0, self.f0 + len(self.filtered))
        self.out.append(np.interp(pos, xp, self.filtered).astype(np.float32))
        self.done = n_out
        keep = max(0, int(np.floor(n_out * self.ratio)) - self.f0)  # the next output's left one
        self.filtered, self.f0 = self.filtered[keep:], self.f0 + keep


def log_mel(x: np.ndarray, rate: int, n_mels: int) -> np.ndarray:
    """Whisper-style log-mel frames [len(x) // hop, n_mels], scaled to roughly [-1, 1]."""
    hop, win = hop_length(rate), round(rate * WIN_S)
    n_fft = 1 << (win - 1).bit_length()
    frames = len(x) // hop
    windows = _frames(np.pad(x, (0, win)), win, hop, frames)
    power = _power(np.fft.rfft(windows * _window(win, False), n=n_fft))
    return _scaled_log(power @ mel_filters(rate, n_fft, n_mels))


def _frames(padded: np.ndarray, win: int, hop: int, frames: int) -> np.ndarray:
    """[frames, win]: the window starting every `hop` samples, a view (nothing copied)."""
    return np.lib.stride_tricks.sliding_window_view(padded, win)[::hop][:frames]


@functools.lru_cache(maxsize=8)
def _window(n: int, periodic: bool) -> np.ndarray:
    """A Hann window of n samples (periodic: the first n of n + 1)."""
    return np.hanning(n + 1)[:-1] if periodic else np.hanning(n)


def _power(spec: np.ndarray) -> np.ndarray:
    """|spec| ** 2, in place of |spec|."""
    power = np.abs(spec)
    return np.square(power, out=power)


def _scaled_log(mel: np.ndarray) -> np.ndarray:
    """log10, floored 8 below the clip's top, (x + 4) / 4, float32; in place of `mel`."""
    logmel = np.log10(np.maximum(mel, 1e-10, out=mel), out=mel)
    np.maximum(logmel, logmel.max(initial=-10.0) - 8.0, out=logmel)
    logmel += 4.0
    logmel /= 4.0
    return logmel.astype(np.float32)


def whisper_log_mel(x: np.ndarray, rate: int, n_mels: int) -> np.ndarray:
    """Whisper's log-mel frames [len(x) // hop, n_mels], as its feature extractor computes them
    for a clip at the start of its 30 s window: 400-sample periodic-Hann frames every 160
    samples (at 16 kHz), centred (reflected before the clip, the window's zeros after it),
    power spectrum, Slaney mel, log10, floored 8 below the clip's top, (x + 4) / 4."""
    hop, n_fft = hop_length(rate), round(rate * WIN_S)
    half = n_fft // 2
    head = np.pad(x, (half, 0), mode="reflect") if len(x) > half else np.pad(x, (half, 0))
    padded = np.pad(head, (0, half))
    frames = len(x) // hop
    windows = _frames(padded, n_fft, hop, frames)
    power = _power(np.fft.rfft(windows * _window(n_fft, True), n=n_fft))
    return _scaled_log(power @ slaney_filters(rate, n_fft, n_mels))


def gemma4_log_mel(x: np.ndarray, rate: int, n_mels: int) -> np.ndarray:
    """Gemma 4's log-mel frames [valid_frames, n_mels], as Gemma4AudioFeatureExtractor
    computes them with its defaults (no preemphasis, dither or per-bin normalisation): FRAME_S
    periodic-Hann frames every hop, the first centred at the clip's start (half a frame of
    zeros before it), the FFT's magnitude, HTK mel filters up to 8 kHz without a norm,
    log(mel + 1e-3)."""
    hop, frame = hop_length(rate), round(rate * FRAME_S)
    n_fft = 1 << (frame - 1).bit_length()
    frames = valid_frames(len(x), rate, rate)
    padded = np.pad(np.asarray(x, np.float32), (frame // 2, 0))
    window = _window(frame, True).astype(np.float32)
    windows = _frames(padded, frame, hop, frames) * window
    magnitude = np.abs(np.fft.rfft(windows, n=n_fft))
    filters = mel_filters(rate, n_fft, n_mels, top=GEMMA4_MAX_HZ)
    return np.log(magnitude @ filters.astype(np.float64) + GEMMA4_MEL_FLOOR).astype(np.float32)


@functools.lru_cache(maxsize=8)
def slaney_filters(rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular mel filterbank [n_fft // 2 + 1, n_mels] up
    to 8 kHz (librosa's default; Whisper's)."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, step = min_log_hz / f_sp, np.log(6.4) / 27.0
    to_mel = lambda f: np.where(
        f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-9) / min_log_hz) / step, f / f_sp
    )
    to_hz = lambda m: np.where(
        m >= min_log_mel, min_log_hz * np.exp(step * (m - min_log_mel)), f_sp * m
    )
    edges = to_hz(np.linspace(to_mel(0.0), to_mel(min(8000.0, rate / 2)), n_mels + 2))
    freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    up = (freqs[:, None] - lo) / (mid - lo)
    down = (hi - freqs[:, None]) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)) * (2.0 / (hi - lo))


@functools.lru_cache(maxsize=8)
def mel_filters(rate: int, n_fft: int, n_mels: int, top: float = 0.0) -> np.ndarray:
    """Triangular HTK-mel filterbank [n_fft // 2 + 1, n_mels] up to `top` Hz (0: rate / 2)."""
    to_mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)
    to_hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    edges = to_hz(np.linspace(0.0, to_mel(top or rate / 2), n_mels + 2))
    freqs = np.linspace(0.0, rate // 2 if top else rate / 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    up = (freqs[:, None] - lo) / np.maximum(mid - lo, 1e-9)
    down = (hi - freqs[:, None]) / np.maximum(hi - mid, 1e-9)
    return np.maximum(0.0, np.minimum(up, down)).astype(np.float32)


def load_audio(
    src: Source,
    target_rate: int,
    n_mels: int,
    subsample: int,
    max_frames: int,
    expect_samples: int | None = None,
    record_id: str = "?",
    max_seconds: float = MAX_SECONDS,
    mel: str = "jaxmllm",
    caps: Caps | None = None,
) -> list[np.ndarray]:
    """Decode, mono, resample (block by block), log-mel (`mel`: jaxmllm | whisper, see
    `LOG_MELS`), cut into chunks: frames [f, n_mels] per chunk.

    `expect_samples` is the length the index read from the header; a decoder that returns a
    slightly different length (a few samples, as some OGG streams do) is padded or trimmed to
    it, a clearly different one is rejected as changed since the index was built.
    """
    caps = caps or Caps(seconds=max_seconds)
    with open_mono(src, record_id, caps) as (frames, rate, blocks):
        want = frames if expect_samples is None else expect_samples
        resampler, got = Resampler(rate, target_rate), 0
        for x in blocks:
            resampler.feed(x[: max(0, want - got)])  # (past `want`: trimmed)
            got += len(x)
    if expect_samples is None:
        want = min(got, frames)
    elif got != expect_samples and abs(got - expect_samples) > max(
        rate // 100, expect_samples // 100
    ):
        raise RecordError(
            "changed_since_index",
            f"{_name(src)}: {got} samples, the index measured {expect_samples}",
            record_id,
        )
    n_frames = clip_frames(want, rate, target_rate, subsample, framing(mel))
    if n_frames == 0:
        raise RecordError("audio_too_short", f"{_name(src)}: {want / rate:.3f} s", record_id)
    feats = LOG_MELS[mel](resampler.finish(want), target_rate, n_mels)[:n_frames]
    # (Gemma 4's: its last token's frames past the clip are zeros, as its extractor masks them)
    feats = np.pad(feats, [(0, n_frames - len(feats)), (0, 0)])
    frames = n_frames
    starts = np.cumsum([0] + chunk_lengths(frames, max_frames))
    return [feats[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _soundfile():
    """soundfile (libsndfile through cffi), imported where a clip is read: a run without audio
    needs neither it nor cffi (a GPU image carries jax but not these)."""
    try:
        import soundfile
    except ImportError as e:  # (soundfile itself, or the cffi it loads libsndfile through)
        raise UserError(
            f"reading audio needs the soundfile package ({e}): pip install soundfile (it "
            "brings cffi), or carry both as wheels (python -m jaxmllm.bench.gpu --wheels DIR)"
        ) from None
    return soundfile


def _file(src: Source):
    """What soundfile opens: a path as it is, inline bytes as a seekable file."""
    return _Bytes(src) if isinstance(src, bytes) else src


class _Bytes(io.BytesIO):
    """Inline audio for libsndfile: a seek before the start fails by staying put (libsndfile
    checks the position it gets back) instead of raising, which soundfile's callback could only
    print as an ignored exception on stderr."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """A seek before the start stays where it is and says so, instead of raising."""
        try:
            return super().seek(offset, whence)
        except ValueError:
            return self.tell()


def _what(src: Source, e: Exception) -> str:
    """A decoder's exception as a reject's detail (the file, the error; at most 500 characters)."""
    return f"{_name(src)}: {type(e).__name__}: {e}"[:500]


def _name(src: Source) -> str:
    """The file's path, or how many inline bytes it is."""
    return f"<{len(src)} inline bytes>" if isinstance(src, bytes) else str(src)


LOG_MELS = {"jaxmllm": log_mel, "whisper": whisper_log_mel, GEMMA4: gemma4_log_mel}  # data.mel
