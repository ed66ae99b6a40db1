"""Images: header sizes, decoding to RGB, the pixel-budget resize rule, native-resolution patches.

`image_grid` is the one resize rule: the index applies it to the header size and preprocessing to
the decoded size, so the index's patch counts are exactly what training sees. It rounds each side
into the budget (`round`, Qwen2-VL's) or floors both to the budget's size (`floor`, Gemma 4's
`get_aspect_ratio_preserving_size`: `data.image_resize`).
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from jaxmllm.data import budget
from jaxmllm.data.media.jpeg import ScanCaps, jpeg_data, jpeg_scans
from jaxmllm.data.rejects import MAX_MEDIA_BYTES, RecordError, check_media_file

ORIENTATION = 0x0112  # EXIF tag; values 5..8 swap width and height
Source = str | Path | bytes
# (patch, merge, min_pixels, max_pixels, rule): `image_grid`'s arguments
Grid = tuple[int, int, int, int, str]
RESIZE_RULES = ("round", "floor")  # data.image_resize
MAX_PIXELS = 1 << 26  # the default of data.max_image_pixels
# Raster formats PIL may open (others are refused as undecodable): the common dataset formats.
# MPO is how PIL opens many camera JPEGs. Left out: EPS/PS (Ghostscript), ICO/ICNS/CUR (the
# decoded size is not the header's), and the long tail of rare formats.
Image.init()
FORMATS = tuple(
    f
    for f in ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF", "PPM", "TGA", "AVIF", "QOI")
    if f in Image.OPEN
)


@dataclass(frozen=True)
class ImageCaps:
    """What an image may cost before a pixel of it is decoded (`open_image` refuses it past
    any): the defaults are the data config's."""

    max_pixels: int = MAX_PIXELS  # data.max_image_pixels: the header's width x height
    max_bytes: int = MAX_MEDIA_BYTES  # data.max_media_bytes: the file's size
    scans: ScanCaps = field(default_factory=ScanCaps)  # a progressive JPEG's scans
    # data.worker_memory, resolved: bytes decoding it may take (`decoding_memory`; 0: no budget)
    max_memory: int = 0


def image_grid(
    h: int,
    w: int,
    patch: int,
    merge: int,
    min_pixels: int,
    max_pixels: int,
    rule: str = "round",
) -> tuple[int, int]:
    """Patch grid (rows, cols) of an h x w image resized into [min_pixels, max_pixels].

    Keeps the aspect ratio and rounds each side to a multiple of patch*merge pixels (so merge
    blocks tile the grid), never below one block and never above max_pixels. `rule` floor:
    `floor_grid` (min_pixels is not read).
    """
    if rule == "floor":
        return floor_grid(h, w, patch, merge, max_pixels)
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


def floor_grid(h: int, w: int, patch: int, merge: int, max_pixels: int) -> tuple[int, int]:
    """Gemma 4's resize (its processor's `get_aspect_ratio_preserving_size`, the same float
    arithmetic): the image scaled to `max_pixels` at its aspect ratio, each side floored to a
    multiple of patch*merge pixels; a side that floors to nothing is one block, the other
    floor(long / short) blocks, at most the budget's blocks in a line."""
    unit = patch * merge
    factor = math.sqrt(max_pixels / (h * w))
    th = int(math.floor(factor * h / unit)) * unit
    tw = int(math.floor(factor * w / unit)) * unit
    longest = (max_pixels // patch**2 // merge**2) * unit
    if th == 0 and tw == 0:  # (a budget under one block: `Params` refuses it)
        th = tw = unit
    elif th == 0:
        th, tw = unit, min(int(math.floor(w / h)) * unit, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(h / w)) * unit, longest), unit
    return th // patch, tw // patch


def open_image(
    src: Source, record_id: str = "?", caps: ImageCaps = ImageCaps(), grid: Grid | None = None
) -> Image.Image:
    """Opens an image from a path or bytes, reading its header only.

    Refuses, before any pixel is decoded (`caps`), a file of more than `max_bytes`, an image of
    more than `max_pixels` (a decompression bomb: a few KB of PNG can hold gigapixels of
    zeros), a progressive JPEG of more scans than `scans` allow (a decoding-time bomb:
    `jpeg_scans`), a JPEG whose entropy-coded data is too short for the frame its header
    claims (`jpeg_data`), one whose decoding would take more than `max_memory` bytes
    (data.worker_memory, estimated by `image_memory` for the size `grid` resizes it to), an
    empty one, and formats outside FORMATS (PIL would also try EPS through Ghostscript, icons
    whose decoded size is not the header's...).
    """
    check_media_file(src, record_id, caps.max_bytes)
    try:
        with _bomb_check_as_error():
            img = Image.open(io.BytesIO(src) if isinstance(src, bytes) else src, formats=FORMATS)
    except Image.DecompressionBombError as e:
        detail = f"{_name(src)}: {e} (PIL's Image.MAX_IMAGE_PIXELS x 2 applies above ours)"
        raise RecordError("image_too_large", detail, record_id) from None
    except Exception as e:  # noqa: BLE001  PIL raises anything on hostile bytes; see decode_rgb
        raise RecordError("undecodable_media", _what(src, e), record_id) from None
    w, h = img.size
    if w * h > caps.max_pixels:
        img.close()
        raise RecordError(
            "image_too_large",
            f"{_name(src)}: {w}x{h} = {w * h} pixels > data.max_image_pixels={caps.max_pixels}",
            record_id,
        )
    if w <= 0 or h <= 0:
        img.close()
        raise RecordError("undecodable_media", f"{_name(src)}: empty image ({w}x{h})", record_id)
    if img.format in ("JPEG", "MPO"):
        _check_jpeg_data(img, src, w, h, record_id)
    if caps.max_memory:
        memory = caps.max_memory
        cost = decoding_memory(w, h, img.mode, img.format, grid, memory)
        if cost > memory:
            img.close()
            what = f"{_name(src)}: decoding {w}x{h} {img.mode} {img.format}"
            raise RecordError("over_memory_budget", budget.over(cost, memory, what), record_id)
    if img.format in ("JPEG", "MPO") and img.info.get("progressive"):
        # Each scan is a pass over the whole image: the cost is scans x pixels, bounded by
        # both caps (a dozen scans of a 64 Mpx photo pass; 100 scans of 16 Mpx do not).
        limit = caps.scans
        affordable = limit.affordable(w * h)
        scans = jpeg_scans(src, affordable)
        if scans > affordable:
            img.close()
            over = (
                f"more than {limit.max_scans} scans > data.max_image_scans={limit.max_scans}"
                if affordable == limit.max_scans
                else f"{scans}+ scans x {w}x{h} pixels > "
                f"data.max_image_scan_pixels={limit.max_scan_pixels}"
            )
            raise RecordError(
                "image_too_costly",
                f"{_name(src)}: a progressive JPEG of {over} (each scan decodes the whole "
                f"{w}x{h} image)",
                record_id,
            )
    return img


def _check_jpeg_data(img: Image.Image, src: Source, w: int, h: int, record_id: str) -> None:
    """Refuses a JPEG whose data is too short for its frame (`jpeg_data`), before decoding."""
    if isinstance(src, bytes):
        problem = jpeg_data(src, w, h)
    else:
        with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            problem = jpeg_data(data, w, h)
    if problem:
        img.close()
        raise RecordError("undecodable_media", f"{_name(src)}: {problem}", record_id)


def read_size(
    src: Source, record_id: str = "?", caps: ImageCaps = ImageCaps(), grid: Grid | None = None
) -> tuple[int, int]:
    """(height, width) as displayed (EXIF orientation applied), read from the header only
    (`open_image` refuses it over `caps`).

    Also checks the end-of-image marker of JPEG and PNG files, which catches truncated files
    without decoding them.
    """
    with open_image(src, record_id, caps, grid) as img:
        w, h = img.size
        orientation = _orientation(img)
        fmt = img.format
    if not _tail_ok(src, fmt):
        raise RecordError("undecodable_media", f"{_name(src)}: truncated {fmt} file", record_id)
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


def decode_rgb(src: Source, record_id: str = "?", caps: ImageCaps = ImageCaps()) -> np.ndarray:
    """Decodes the first frame to uint8 RGB [h, w, 3], EXIF orientation applied (`open_image`
    refuses it over `caps`).

    Grayscale, palette, CMYK and 16-bit images are converted; transparency is composited on white.
    The image must decode to the size its header announced (what the index counted).
    """
    return _decode(src, record_id, caps, None)[0]


def _decode(src: Source, record_id: str, caps: ImageCaps, grid: Grid | None):
    """(uint8 RGB [h, w, 3] as displayed, (height, width) displayed from the header).

    An image whose decoding at full size would cost more than the memory budget (`caps`'
    last, data.worker_memory: `decoding_memory`) is decoded smaller where a library call does
    it without a full-size copy, given `grid` (what it is resized to): a JPEG by its DCT
    scaling (`draft`: 1/2, 1/4, 1/8 of each side), any image by `reduce` (whole-pixel box
    averaging) before it is converted to RGB, never below its target size; the conversion's
    copies are then the small image's. Within the budget (as almost every image is) it is
    decoded whole, as it always was: the same pixels to the bit."""
    with open_image(src, record_id, caps, grid) as img:
        w, h = img.size
        orientation = _orientation(img)
        turned = orientation in (5, 6, 7, 8)
        shown = (w, h) if turned else (h, w)
        memory = caps.max_memory
        small = bool(memory) and grid is not None
        whole = image_memory(w, h, img.mode, img.format, target_of(h, w, grid), False)
        small = small and whole > memory
        try:
            with _bomb_check_as_error():
                img.seek(0)
                if small and img.format in ("JPEG", "MPO"):
                    th, tw = target_of(h, w, grid)  # (stored orientation: the same rule)
                    img.draft(None, (tw, th))
                expect = img.size
                img.load()
                if img.size != expect:
                    raise ValueError(f"decoded {img.size[0]}x{img.size[1]}, header {expect}")
                if small:
                    img = _reduced(img, *target_of(h, w, grid))
                rgb = _to_rgb(img)
        # The decoders are C libraries behind PIL's Python plugins; on hostile bytes they raise
        # OSError, ValueError, SyntaxError, struct.error, IndexError, TypeError, ... Any of them
        # means the same thing here: this file cannot become pixels.
        except Exception as e:  # noqa: BLE001
            raise RecordError("undecodable_media", _what(src, e), record_id) from None
    return _orient(rgb, orientation), shown


def target_of(h: int, w: int, grid: Grid | None) -> tuple[int, int]:
    """(height, width) in pixels that `grid`'s rule resizes an h x w image to (its own size
    without one)."""
    if grid is None:
        return h, w
    gh, gw = image_grid(h, w, *grid)
    return gh * grid[0], gw * grid[0]


def _reduced(img: Image.Image, th: int, tw: int) -> Image.Image:
    """`img` reduced by the largest whole factor that keeps it at least th x tw (itself when
    that is 1). A mode `reduce` does not take (a palette, 1-bit) is converted first."""
    k = min(img.width // max(tw, 1), img.height // max(th, 1))
    if k < 2:
        return img
    if img.mode in ("P", "PA", "1"):
        alpha = img.mode == "PA" or "transparency" in img.info
        img = img.convert("RGBA" if alpha else "RGB")
    try:
        return img.reduce(k)
    except ValueError:  # (a mode it does not reduce: converted where it is)
        return img


def decoding_memory(
    w: int, h: int, mode: str, fmt: str | None, grid: Grid | None, budget: int
) -> int:
    """Bytes decoding a w x h image of `mode` takes (`image_memory`): whole, when that fits
    `budget`; else decoded smaller for `grid`'s target, where there is one (`_decode`)."""
    whole = image_memory(w, h, mode, fmt, target_of(h, w, grid), False)
    if whole <= budget or grid is None:
        return whole
    return image_memory(w, h, mode, fmt, target_of(h, w, grid), True)


def image_memory(
    w: int, h: int, mode: str, fmt: str | None, target: tuple[int, int], small: bool
) -> int:
    """Bytes decoding a w x h image of `mode` to RGB at `target` (height, width) may take at
    once (`_decode`): the decoded image as Pillow stores it (4 bytes a pixel for 3 and 4
    channels) and the conversions' copies (about 24 bytes a pixel: RGBA, the white it is
    composited on, RGB, the array, turned); decoded `small`, a converted copy beside the
    decoded image and the conversions of the reduced one; then the target's resize and
    patches."""
    th, tw = target
    scale = 1
    if small and fmt in ("JPEG", "MPO"):  # (`draft`: the largest of 8, 4, 2 the target allows)
        fit = min(w // max(tw, 1), h // max(th, 1))
        scale = next((s for s in (8, 4, 2) if fit >= s), 1)
    dw, dh = -(-w // scale), -(-h // scale)
    stored = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    k = min(dw // max(tw, 1), dh // max(th, 1)) if small else 1
    decoded = dw * dh
    if k >= 2:
        work = decoded * (stored + 8) + -(-dw // k) * -(-dh // k) * 24
    else:
        work = decoded * (stored + 24)
    return int(work + tw * th * 3 * 4)


def load_image(
    src: Source,
    patch: int,
    merge: int,
    min_pixels: int,
    max_pixels: int,
    record_id: str = "?",
    caps: ImageCaps = ImageCaps(),
    rule: str = "round",
) -> tuple[np.ndarray, np.ndarray]:
    """Decode (refusing an image over `caps`: `open_image`), resize to the pixel budget
    [`min_pixels`, `max_pixels`] by `rule` (`image_grid`), patchify.

    The patch grid is the header's size's (what the index counted); an image decoded smaller
    (`_decode`) is resampled to it.

    Returns (patches [n, patch*patch*3] uint8 RGB pixels, positions [n, 2] as (row, col)):
    the encoder normalises them on the device (`jaxmllm.config.spec.Inputs`: (x / 255 -
    data.image_mean) / data.image_std per channel; `Inputs.normalise` on the host).
    """
    grid = (patch, merge, min_pixels, max_pixels, rule)
    rgb, (h, w) = _decode(src, record_id, caps, grid)
    gh, gw = image_grid(h, w, *grid)
    if rgb.shape[:2] == (h, w):
        rgb = fit_to_grid(rgb, gh * patch, gw * patch, patch * merge)
    else:  # (decoded smaller, by a whole factor: resampled to the grid)
        size = (gw * patch, gh * patch)
        rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.BICUBIC))
    return patch_rows(rgb, patch, merge), patch_positions(gh, gw, merge)


def fit_to_grid(rgb: np.ndarray, height: int, width: int, unit: int) -> np.ndarray:
    """`rgb` at `height` x `width` pixels (its patch grid, from `image_grid`).

    An image that only needs rounding to the grid (each side within half a merge block, `unit`
    / 2 pixels, of its target) is centre-cropped or edge-padded to it: resampling it would
    blur every pixel to move the border by a few. Others are resized (bicubic).
    """
    h, w = rgb.shape[:2]
    if (h, w) == (height, width):
        return rgb
    if abs(h - height) > unit // 2 or abs(w - width) > unit // 2:
        return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))
    top, left = (h - height) // 2, (w - width) // 2  # (negative: padded)
    rgb = rgb[max(top, 0) : max(top, 0) + height, max(left, 0) : max(left, 0) + width]
    if height <= h and width <= w:
        return rgb
    pad_h, pad_w = max(-top, 0), max(-left, 0)  # the edge rows and columns repeated
    widths = ((pad_h, height - rgb.shape[0] - pad_h), (pad_w, width - rgb.shape[1] - pad_w), (0, 0))
    return np.pad(rgb, widths, mode="edge")


def _to_rgb(img: Image.Image) -> np.ndarray:
    """A decoded image as uint8 RGB [h, w, 3]: 16-bit and float grayscale scaled to 8 bits,
    transparency composited on white, any other mode converted by PIL."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit / float grayscale
        a = np.asarray(img, np.float32)
        scale = 65535.0 if img.mode != "F" else max(float(a.max()), 1.0)
        g = np.clip(a / scale * 255.0, 0, 255).astype(np.uint8)
        return np.repeat(g[..., None], 3, axis=-1)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return np.asarray(img if img.mode == "RGB" else img.convert("RGB"))


def _orientation(img: Image.Image) -> int:
    """The image's EXIF orientation (1..8; 1, upright, where it has none or a broken block)."""
    try:
        if img.format == "PNG" and "exif" not in img.info and _png_tail_read(img):
            return int(Image.Image.getexif(img).get(ORIENTATION, 1))  # (all but the pixels)
        return int(img.getexif().get(ORIENTATION, 1))
    except Exception:  # noqa: BLE001  a broken EXIF block does not stop decoding: upright
        return 1


def _png_tail_read(img: Image.Image) -> bool:
    """Reads the eXIf chunk a PNG may hold after its pixel data into `img.info` as PIL would
    once decoded, walking the chunks (PIL's getexif decodes the whole image to reach it).

    False (nothing read) when text chunks follow the pixel data: they may hold EXIF or XMP
    orientation too, which PIL's getexif reads after decoding.
    """
    fp, at = img.fp, img.fp.tell()
    exif, after_pixels = None, False
    try:
        fp.seek(8)  # the signature
        while len(head := fp.read(8)) == 8:
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IEND":
                break
            if kind == b"eXIf":
                exif = fp.read(length)
                fp.seek(4, io.SEEK_CUR)
                continue
            if after_pixels and kind in (b"tEXt", b"zTXt", b"iTXt"):
                return False
            after_pixels = after_pixels or kind == b"IDAT"
            fp.seek(length + 4, io.SEEK_CUR)  # data and CRC
    finally:
        fp.seek(at)
    if exif is not None:
        img.info["exif"] = b"Exif\x00\x00" + exif
    return True


def _orient(rgb: np.ndarray, orientation: int) -> np.ndarray:
    """Applies an EXIF orientation (1..8, as ImageOps.exif_transpose) to an [h, w, 3] array;
    other values count as upright."""
    op = _ORIENT.get(orientation)
    return np.ascontiguousarray(op(rgb)) if op else rgb


_T = lambda a: a.transpose(1, 0, 2)
_ORIENT = {
    2: np.fliplr,
    3: lambda a: np.rot90(a, 2),
    4: np.flipud,
    5: _T,
    6: lambda a: np.rot90(a, 3),
    7: lambda a: np.rot90(_T(a), 2),
    8: np.rot90,
}


@contextlib.contextmanager
def _bomb_check_as_error():
    """PIL warns (DecompressionBombWarning) between MAX_IMAGE_PIXELS and twice that, and raises
    above; our own cap decides, so its warning is silenced here and its error becomes a reject."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def _what(src: Source, e: Exception) -> str:
    """A decoder's exception as a reject's detail (the file, the error; at most 500 characters)."""
    return f"{_name(src)}: {type(e).__name__}: {e}"[:500]


def _tail_ok(src: Source, fmt: str | None) -> bool:
    """Whether a JPEG or PNG file ends with its end marker in its last 64 bytes (a truncated
    file does not); other formats pass."""
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
    """The file's path, or how many inline bytes it is."""
    return f"<{len(src)} inline bytes>" if isinstance(src, bytes) else str(src)


def patchify(img_hwc: np.ndarray, patch: int, merge: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Cuts an image into patches ordered so each run of merge*merge patches is one merge block.

    Returns (patches [gh*gw, patch*patch*C] of the image's dtype (uint8 pixels: what a vision
    bucket takes), positions [gh*gw, 2] as (row, col)).
    """
    h, w, _ = img_hwc.shape
    return patch_rows(img_hwc, patch, merge), patch_positions(h // patch, w // patch, merge)


def patch_rows(img_hwc: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """[gh*gw, patch*patch*C] of the image's dtype, in merge-block order (one copy)."""
    h, w, c = img_hwc.shape
    gh, gw = h // patch, w // patch
    # (block row, row in block, pixel row, block col, col in block, pixel col, channel)
    x = img_hwc[: gh * patch, : gw * patch].reshape(
        gh // merge, merge, patch, gw // merge, merge, patch, c
    )
    return x.transpose(0, 3, 1, 4, 2, 5, 6).reshape(gh * gw, patch * patch * c)


def patch_positions(gh: int, gw: int, merge: int) -> np.ndarray:
    """(row, col) of each patch of a gh x gw grid, int32 [gh*gw, 2], in merge-block order."""
    rows, cols = np.mgrid[0:gh, 0:gw]
    grid = np.stack([rows, cols], -1).astype(np.int32)
    return patch_rows(grid, 1, merge)
