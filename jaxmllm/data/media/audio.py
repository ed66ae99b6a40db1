"""Audio: header lengths, decoding to mono, resampling, log-mel frames, chunking (numpy only).

Frames are 25 ms Hann windows every 10 ms at the target rate, so a clip of n samples at rate sr
has `clip_frames(n, sr, ...)` frames: the index computes that from the header, preprocessing
from the decoded clip, with the same function.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import soundfile as sf

from jaxmllm.data.rejects import RecordError, check_media_file

Source = str | Path | bytes
HOP_S, WIN_S = 0.010, 0.025
MAX_SECONDS = 600.0  # the default of data.max_audio_seconds
MAX_RATE = 768_000  # Hz; above any real recording: a header saying more is broken or hostile
BLOCK = 1 << 16  # frames decoded at a time


def clip_frames(num_samples: int, sample_rate: int, target_rate: int, subsample: int) -> int:
    """Log-mel frames of a clip after resampling, rounded down to a multiple of `subsample`."""
    frames = resampled_length(num_samples, sample_rate, target_rate) // hop_length(target_rate)
    return frames - frames % subsample


def chunk_lengths(frames: int, max_frames: int) -> list[int]:
    """Cuts `frames` into chunks of at most `max_frames` (the last one shorter)."""
    full, rest = divmod(frames, max_frames)
    return [max_frames] * full + ([rest] if rest else [])


def resampled_length(num_samples: int, sample_rate: int, target_rate: int) -> int:
    return num_samples * target_rate // sample_rate


def hop_length(rate: int) -> int:
    return round(rate * HOP_S)


def read_info(
    src: Source, record_id: str = "?", max_seconds: float = MAX_SECONDS
) -> tuple[int, int]:
    """(samples per channel, sample rate) from the header, without decoding.

    Refuses a clip longer than `max_seconds` and implausible headers before any sample is read.
    """
    check_media_file(src, record_id)
    try:
        info = sf.info(_file(src))
    except Exception as e:  # noqa: BLE001  libsndfile's errors on hostile bytes; see decode_mono
        raise RecordError("undecodable_media", _what(src, e), record_id) from None
    _check_header(src, info.frames, info.samplerate, info.channels, max_seconds, record_id)
    return int(info.frames), int(info.samplerate)


def decode_mono(
    src: Source, record_id: str = "?", max_seconds: float = MAX_SECONDS
) -> tuple[np.ndarray, int]:
    """Decodes to float32 mono (the mean of the channels) and returns (samples, rate).

    The header is checked as `read_info` does, then at most its frame count is read, in blocks
    mixed down as they come: memory stays at the mono clip whatever the channel count.
    """
    check_media_file(src, record_id)
    try:
        with sf.SoundFile(_file(src)) as f:
            frames, rate = f.frames, f.samplerate
            _check_header(src, frames, rate, f.channels, max_seconds, record_id)
            x = np.empty(frames, np.float32)
            n = 0
            if f.channels == 1:  # straight into x (the mean of one channel is itself)
                n = len(f.read(frames, dtype="float32", out=x))
            for block in f.blocks(BLOCK, dtype="float32", always_2d=True, frames=frames - n):
                with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf: rejected below
                    x[n : n + len(block)] = block.mean(axis=1)
                n += len(block)
    except RecordError:
        raise
    # libsndfile (through soundfile's cffi layer) raises LibsndfileError, RuntimeError,
    # TypeError, ValueError, ... on hostile bytes; all mean this file cannot become samples.
    except Exception as e:  # noqa: BLE001
        raise RecordError("undecodable_media", _what(src, e), record_id) from None
    if not np.isfinite(x[:n]).all():  # float WAV/AIFF can store NaN and inf: they poison the loss
        raise RecordError("undecodable_media", f"{_name(src)}: non-finite samples", record_id)
    return x[:n], int(rate)


def _check_header(src, frames, rate, channels, max_seconds, record_id) -> None:
    if frames <= 0 or rate <= 0 or channels <= 0:
        raise RecordError("undecodable_media", f"{_name(src)}: empty or unknown length", record_id)
    if rate > MAX_RATE:
        raise RecordError(
            "undecodable_media", f"{_name(src)}: implausible sample rate {rate} Hz", record_id
        )
    if frames > max_seconds * rate:
        raise RecordError(
            "audio_too_long",
            f"{_name(src)}: {frames / rate:.1f} s > data.max_audio_seconds={max_seconds}",
            record_id,
        )


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited linear-interpolation resampling to `resampled_length` samples."""
    if rate == target:
        return x.astype(np.float32)
    if target < rate:  # low-pass below the new Nyquist first (windowed sinc, 63 taps)
        cutoff = 0.5 * target / rate
        t = np.arange(-31, 32)
        taps = 2 * cutoff * np.sinc(2 * cutoff * t) * np.hamming(len(t))
        x = np.convolve(x, taps / taps.sum(), mode="same")
    n = resampled_length(len(x), rate, target)
    pos = np.arange(n) * (rate / target)
    return np.interp(pos, np.arange(len(x)), x).astype(np.float32)


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


@functools.lru_cache(maxsize=8)
def slaney_filters(rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular mel filterbank [n_fft // 2 + 1, n_mels] up
    to 8 kHz (librosa's default; Whisper's)."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, step = min_log_hz / f_sp, np.log(6.4) / 27.0
    to_mel = lambda f: np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-9) /
                                min_log_hz) / step, f / f_sp)  # fmt: skip
    to_hz = lambda m: np.where(m >= min_log_mel, min_log_hz * np.exp(step * (m - min_log_mel)),
                               f_sp * m)  # fmt: skip
    edges = to_hz(np.linspace(to_mel(0.0), to_mel(min(8000.0, rate / 2)), n_mels + 2))
    freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    up = (freqs[:, None] - lo) / (mid - lo)
    down = (hi - freqs[:, None]) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)) * (2.0 / (hi - lo))


@functools.lru_cache(maxsize=8)
def mel_filters(rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular HTK-mel filterbank [n_fft // 2 + 1, n_mels]."""
    to_mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)
    to_hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    edges = to_hz(np.linspace(0.0, to_mel(rate / 2), n_mels + 2))
    freqs = np.linspace(0.0, rate / 2, n_fft // 2 + 1)
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
) -> list[np.ndarray]:
    """Decode, mono, resample, log-mel (`mel`: jaxmllm | whisper, see `LOG_MELS`), cut into
    chunks: frames [f, n_mels] per chunk.

    `expect_samples` is the length the index read from the header; a decoder that returns a
    slightly different length (a few samples, as some OGG streams do) is padded or trimmed to
    it, a clearly different one is rejected as changed since the index was built.
    """
    x, rate = decode_mono(src, record_id, max_seconds)
    if expect_samples is not None and len(x) != expect_samples:
        if abs(len(x) - expect_samples) > max(rate // 100, expect_samples // 100):
            raise RecordError(
                "changed_since_index",
                f"{_name(src)}: {len(x)} samples, the index measured {expect_samples}",
                record_id,
            )
        x = np.pad(x, (0, max(0, expect_samples - len(x))))[:expect_samples]
    frames = clip_frames(len(x), rate, target_rate, subsample)
    if frames == 0:
        raise RecordError("audio_too_short", f"{_name(src)}: {len(x) / rate:.3f} s", record_id)
    feats = LOG_MELS[mel](resample(x, rate, target_rate), target_rate, n_mels)[:frames]
    starts = np.cumsum([0] + chunk_lengths(frames, max_frames))
    return [feats[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _file(src: Source):
    return _Bytes(src) if isinstance(src, bytes) else src


class _Bytes(io.BytesIO):
    """Inline audio for libsndfile: a seek before the start fails by staying put (libsndfile
    checks the position it gets back) instead of raising, which soundfile's callback could only
    print as an ignored exception on stderr."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return super().seek(offset, whence)
        except ValueError:
            return self.tell()


def _what(src: Source, e: Exception) -> str:
    return f"{_name(src)}: {type(e).__name__}: {e}"[:500]


def _name(src: Source) -> str:
    return f"<{len(src)} inline bytes>" if isinstance(src, bytes) else str(src)


LOG_MELS = {"jaxmllm": log_mel, "whisper": whisper_log_mel}  # data.mel
