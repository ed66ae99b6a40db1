"""Decoding's cheap paths: what the model sees, against the plain computation (PIL's resize,
normalising the image before cutting it), and no pixel decoded to read a header."""

import numpy as np
import pytest

from jaxmllm.data.media import audio as au


def _log_mel_reference(x, rate, n_mels, whisper):
    """Log-mel the plain way: gather every frame by index, window, |rfft|^2, filters, log."""
    hop, win = au.hop_length(rate), round(rate * au.WIN_S)
    if whisper:
        n_fft = win
        head = (
            np.pad(x, (n_fft // 2, 0), mode="reflect")
            if len(x) > n_fft // 2
            else np.pad(x, (n_fft // 2, 0))
        )
        padded, window = np.pad(head, (0, n_fft // 2)), np.hanning(n_fft + 1)[:-1]
        filters, size = au.slaney_filters(rate, n_fft, n_mels), n_fft
    else:
        n_fft = 1 << (win - 1).bit_length()
        padded, window = np.pad(x, (0, win)), np.hanning(win)
        filters, size = au.mel_filters(rate, n_fft, n_mels), win
    idx = np.arange(len(x) // hop)[:, None] * hop + np.arange(size)[None, :]
    spec = np.abs(np.fft.rfft(padded[idx] * window, n=n_fft)) ** 2
    logmel = np.log10(np.maximum(spec @ filters, 1e-10))
    logmel = np.maximum(logmel, logmel.max(initial=-10.0) - 8.0)
    return ((logmel + 4.0) / 4.0).astype(np.float32)


@pytest.mark.parametrize("whisper", [False, True])
@pytest.mark.parametrize("rate,seconds", [(16000, 3.37), (22050, 1.0), (16000, 0.02)])
def test_log_mel_frames_are_bit_for_bit_the_plain_computations(rate, seconds, whisper):
    x = (np.random.default_rng(rate).standard_normal(int(rate * seconds)) * 0.3).astype(np.float32)
    fn = au.whisper_log_mel if whisper else au.log_mel
    got, want = fn(x, rate, 80), _log_mel_reference(x, rate, 80, whisper)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)
