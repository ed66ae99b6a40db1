"""Decoding's cheap paths: what the model sees, against the plain computation (PIL's resize,
normalising the image before cutting it), and no pixel decoded to read a header."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

from jaxmllm.config.spec import Inputs
from jaxmllm.data.media import audio as au
from jaxmllm.data.media import image as im

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)


def _png_with_exif_after_pixels(rgb: np.ndarray, orientation: int, text: bool = False) -> bytes:
    """A PNG whose eXIf chunk (and a tEXt one, with `text`) follows its pixel data (IDAT),
    where PIL finds it only after decoding."""
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    data = buf.getvalue()
    exif = Image.Exif()
    exif[im.ORIENTATION] = orientation
    payload = exif.tobytes(8)[6:]  # (the TIFF block, without "Exif\0\0")

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    extra = chunk(b"eXIf", payload) + (chunk(b"tEXt", b"Comment\x00hello") if text else b"")
    end = data.rindex(b"IEND") - 4
    return data[:end] + extra + data[end:]


@pytest.mark.parametrize("text", [False, True])
def test_exif_after_a_pngs_pixels_is_read_and_applied_as_pil_does(text):
    rgb = np.random.default_rng(0).integers(0, 255, (20, 50, 3), dtype=np.uint8)
    png = _png_with_exif_after_pixels(rgb, 6, text)
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(png))).convert("RGB"))
    assert want.shape == (50, 20, 3)  # displayed rotated
    assert im.read_size(png) == (50, 20)
    assert np.array_equal(im.decode_rgb(png), want)


def test_a_pngs_size_and_orientation_are_read_without_decoding_it(monkeypatch):
    rgb = np.random.default_rng(0).integers(0, 255, (20, 50, 3), dtype=np.uint8)
    png = _png_with_exif_after_pixels(rgb, 8)

    def no_decoding(self):
        raise AssertionError("decoded the pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert im.read_size(png) == (50, 20)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")  # no EXIF at all
    assert im.read_size(buf.getvalue()) == (20, 50)


def _reference(rgb, patch, merge, min_px, max_px, mean, std):
    """The plain pipeline: resize with PIL (bicubic) to the grid, normalise the whole image in
    float32, cut it into patches in merge-block order with explicit loops."""
    gh, gw = im.image_grid(*rgb.shape[:2], patch, merge, min_px, max_px)
    if (gh * patch, gw * patch) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((gw * patch, gh * patch), Image.BICUBIC))
    x = (rgb.astype(np.float32) / 255.0 - np.float32(mean)) / np.float32(std)
    if mean == std == (0.5, 0.5, 0.5):
        x = rgb.astype(np.float32) / 127.5 - 1.0
    rows, where = [], []
    for br in range(gh // merge):
        for bc in range(gw // merge):
            for r in range(br * merge, br * merge + merge):
                for c in range(bc * merge, bc * merge + merge):
                    rows.append(x[r * patch : r * patch + patch, c * patch : c * patch + patch])
                    where.append((r, c))
    return np.stack(rows).reshape(len(rows), -1), np.asarray(where, np.int32)


CLIP = ((0.48, 0.46, 0.41), (0.27, 0.26, 0.28))


@pytest.mark.parametrize("mean,std", [((0.5,) * 3, (0.5,) * 3), CLIP])
@pytest.mark.parametrize("h,w", [(56, 84), (400, 700)])  # on the grid; over the budget: resized
def test_loaded_patches_are_bit_for_bit_the_plain_pipelines(h, w, mean, std):
    rgb = np.random.default_rng(h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    got = im.load_image(buf.getvalue(), 14, 2, 3136, 56 * 56 * 16)
    want = _reference(rgb, 14, 2, 3136, 56 * 56 * 16, mean, std)
    assert got[0].dtype == np.uint8 and got[1].dtype == np.int32  # (normalised on the device)
    assert np.array_equal(Inputs.pixels(mean, std).normalise(got[0]), want[0])
    assert np.array_equal(got[1], want[1])


@pytest.mark.parametrize("h,w", [(60, 90), (51, 85), (62, 47)])  # crop, pad, one of each
def test_an_image_near_its_grid_is_cropped_or_padded_not_resampled(h, w):
    rgb = np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    gh, gw = im.image_grid(h, w, 14, 2, 3136, 10**6)
    assert abs(gh * 14 - h) <= 14 and abs(gw * 14 - w) <= 14  # only rounding to the 28 px grid
    fitted = im.fit_to_grid(rgb, gh * 14, gw * 14, 28)
    assert fitted.shape == (gh * 14, gw * 14, 3)
    # every pixel is one of the image's, centred: rows and columns cut or repeated at the edges
    rows = np.clip(np.arange(gh * 14) + (h - gh * 14) // 2, 0, h - 1)
    cols = np.clip(np.arange(gw * 14) + (w - gw * 14) // 2, 0, w - 1)
    assert np.array_equal(fitted, rgb[rows][:, cols])
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    patches, _ = im.load_image(buf.getvalue(), 14, 2, 3136, 10**6)
    assert np.array_equal(patches, im.patchify(fitted, 14, 2)[0])


def test_far_from_its_grid_an_image_is_resized():
    rgb = np.random.default_rng(0).integers(0, 256, (10, 90, 3), dtype=np.uint8)  # 10 px -> 28
    fitted = im.fit_to_grid(rgb, 28, 84, 28)
    want = np.asarray(Image.fromarray(rgb).resize((84, 28), Image.BICUBIC))
    assert np.array_equal(fitted, want)


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


NO_SOUNDFILE = """
import sys
sys.modules["soundfile"] = None  # (as on a Python without it, or without the cffi it needs)
import jaxmllm.train, jaxmllm.data.index
from jaxmllm.config import UserError
from jaxmllm.data.media import audio
try:
    audio.read_info(b"RIFF....WAVE", "r1")
except UserError as e:
    print("refused:", e)
"""


def test_without_soundfile_only_reading_audio_needs_it():
    """soundfile (and the cffi it loads libsndfile through) is imported where a clip is read:
    the trainer imports without it, and reading a clip says what to install."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NO_SOUNDFILE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: reading audio needs the soundfile package" in done.stdout
