"""Images: header sizes, decoding to RGB, the pixel-budget resize rule, native-resolution patches.

`image_grid` is the one resize rule: the index applies it to the header size and preprocessing to
the decoded size, so the index's patch counts are exactly what training sees.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from jaxmllm.data.rejects import RecordError
from jaxmllm.data.synthetic import patchify

ORIENTATION = 0x0112  # EXIF tag; values 5..8 swap width and height
Source = str | Path | bytes


def image_grid(
    h: int, w: int, patch: int, merge: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Patch grid (rows, cols) of an h x w image resized into [min_pixels, max_pixels].

    Keeps the aspect ratio and rounds each side to a multiple of patch*merge pixels (so merge
    blocks tile the grid), never below one block and never above max_pixels.
    """
    unit = patch * merge
    hb, wb = max(unit, round(h / unit) * unit), max(unit, round(w / unit) * unit)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(unit, math.floor(h / beta / unit) * unit)
        wb = max(unit, math.floor(w / beta / unit) * unit)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / unit) * unit, math.ceil(w * beta / unit) * unit
    while hb * wb > max_pixels and max(hb, wb) > unit:  # a side clamped at one block
        if hb >= wb:
            hb -= unit
        else:
            wb -= unit
    return hb // patch, wb // patch


def open_image(src: Source, record_id: str = "?") -> Image.Image:
    """Opens (without decoding) an image from a path or bytes."""
    try:
        return Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)
    except FileNotFoundError:
        raise RecordError("missing_media", f"no such file: {src}", record_id) from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise RecordError("undecodable_media", f"{_name(src)}: {e}", record_id) from None


def read_size(src: Source, record_id: str = "?") -> tuple[int, int]:
    """(height, width) as displayed (EXIF orientation applied), read from the header only.

    Also checks the end-of-image marker of JPEG and PNG files, which catches truncated files
    without decoding them.
    """
    with open_image(src, record_id) as img:
        w, h = img.size
        try:
            orientation = img.getexif().get(ORIENTATION, 1)
        except Exception:  # a broken EXIF block does not stop decoding; treat as upright
            orientation = 1
        fmt = img.format
    if not _tail_ok(src, fmt):
        raise RecordError("undecodable_media", f"{_name(src)}: truncated {fmt} file", record_id)
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


def decode_rgb(src: Source, record_id: str = "?") -> np.ndarray:
    """Decodes the first frame to uint8 RGB [h, w, 3], EXIF orientation applied.

    Grayscale, palette, CMYK and 16-bit images are converted; transparency is composited on white.
    """
    with open_image(src, record_id) as img:
        try:
            img.seek(0)
            img.load()
            img = ImageOps.exif_transpose(img)
            return _to_rgb(img)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise RecordError("undecodable_media", f"{_name(src)}: {e}", record_id) from None


def load_image(
    src: Source,
    patch: int,
    merge: int,
    min_pixels: int,
    max_pixels: int,
    record_id: str = "?",
) -> tuple[np.ndarray, np.ndarray]:
    """Decode, resize to the budget, patchify.

    Returns (patches [n, patch*patch*3] in [-1, 1], positions [n, 2] as (row, col)).
    """
    rgb = decode_rgb(src, record_id)
    gh, gw = image_grid(*rgb.shape[:2], patch, merge, min_pixels, max_pixels)
    size = (gw * patch, gh * patch)
    if size != (rgb.shape[1], rgb.shape[0]):
        rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.BICUBIC))
    x = rgb.astype(np.float32) / 127.5 - 1.0
    return patchify(x, patch, merge)


def _to_rgb(img: Image.Image) -> np.ndarray:
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit / float grayscale
        a = np.asarray(img, np.float32)
        scale = 65535.0 if img.mode != "F" else max(float(a.max()), 1.0)
        g = np.clip(a / scale * 255.0, 0, 255).astype(np.uint8)
        return np.repeat(g[..., None], 3, axis=-1)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return np.asarray(img.convert("RGB"))


def _tail_ok(src: Source, fmt: str | None) -> bool:
    marker = {"JPEG": b"\xff\xd9", "PNG": b"IEND\xaeB`\x82"}.get(fmt or "")
    if marker is None:
        return True
    if isinstance(src, bytes):
        tail = src[-64:]
    else:
        with open(src, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64))
            tail = f.read()
    return marker in tail


def _name(src: Source) -> str:
    return f"<{len(src)} inline bytes>" if isinstance(src, bytes) else str(src)
