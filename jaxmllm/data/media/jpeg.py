"""JPEG's markers, walked without decoding: how many scans a file holds (`jpeg_scans`: each a
pass over the whole image) and whether its data can hold the frame its header claims
(`jpeg_data`). Images (`image.open_image`) and MJPEG video frames (`video.check_jpeg_frame`)
are held to both before a pixel is decoded.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path

from jaxmllm.data.rejects import RecordError

Source = str | Path | bytes
MAX_SCANS = 100  # the default of data.max_image_scans
MAX_SCAN_PIXELS = 1 << 30  # the default of data.max_image_scan_pixels


@dataclass(frozen=True)
class ScanCaps:
    """What decoding a JPEG's scans may cost: each scan of a progressive JPEG is a pass over
    the whole image, so both its scans and scans x pixels are capped."""

    max_scans: int = MAX_SCANS  # data.max_image_scans: scans a progressive JPEG may hold
    # data.max_image_scan_pixels: scans x pixels (a dozen scans of 64 Mpx pass, 100 of 16 do not)
    max_scan_pixels: int = MAX_SCAN_PIXELS

    def affordable(self, pixels: int) -> int:
        """The most scans an image of `pixels` may hold under both caps."""
        return min(self.max_scans, self.max_scan_pixels // max(pixels, 1))


def check_frame(data: bytes, w: int, h: int, caps: ScanCaps, at: str, rid: str) -> None:
    """Raises the reject of a JPEG frame `data` of w x h (`at`: where, for the message) over
    the scan caps (image_too_costly) or whose data cannot hold its frame (undecodable_media);
    nothing for an empty one."""
    if not data:
        return
    affordable = caps.affordable(w * h)
    if jpeg_scans(data, affordable) > affordable:
        raise RecordError(
            "image_too_costly",
            f"{at}: a JPEG of more than {affordable} scans of {w}x{h} pixels "
            f"(data.max_image_scans={caps.max_scans}, "
            f"data.max_image_scan_pixels={caps.max_scan_pixels})",
            rid,
        )
    problem = jpeg_data(data, w, h)
    if problem:
        raise RecordError("undecodable_media", f"{at}: {problem}", rid)


_ARITHMETIC = {0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # frames whose scans are arithmetic-coded


def jpeg_data(data, w: int, h: int) -> str | None:
    """Why the JPEG `data` (bytes, or a mapped file) cannot hold the w x h frame its header
    claims, or None. A Huffman-coded scan spends at least one bit on each 8 x 8 block of each
    component it codes (a DC difference's code), and some scan codes every luma block: bytes
    after the first scan's header fewer than ceil(w / 8) * ceil(h / 8) / 8 are a file cut
    short or forged (a header claiming 8000 x 8000 over 691 bytes), which libjpeg decodes to
    grey (646 MB of it) with a warning instead of an error."""
    pos, end, arithmetic = 2, len(data), False
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            found = _ANY_MARKER.search(data, pos + 1)
            if found is None:
                return None
            pos = found.start()
            continue
        marker = data[pos + 1]
        if marker == 0xFF or marker in _STANDALONE:
            pos += 1 if marker == 0xFF else 2
            continue
        if marker == 0xD9:
            break
        arithmetic |= marker in _ARITHMETIC
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA:
            if arithmetic:  # (arithmetic coding spends less than a bit on a flat block)
                return None
            blocks = -(-w // 8) * -(-h // 8)
            have = max(0, end - pos)
            if have * 8 < blocks:
                return (
                    f"its frame header claims {w}x{h} pixels ({blocks} blocks of 8x8, each at "
                    f"least a bit of data) over {have} bytes of scan data: a JPEG cut short or "
                    "forged (libjpeg would decode it to grey), not decoded"
                )
            return None
    return None


# A marker in a JPEG's entropy-coded data: 0xFF, then neither a stuffed 0x00 nor a restart.
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")
_ANY_MARKER = re.compile(rb"\xff[^\x00\xff]")  # (fill bytes 0xFF before it: part of none)
_STANDALONE = {0x01, 0xD8, *range(0xD0, 0xD8)}  # markers without a length


def jpeg_scans(src: Source, limit: int) -> int:
    """The scans (SOS markers) of the JPEG at `src`, counted by walking its marker segments
    and skipping each scan's entropy-coded data to the next marker; stops past `limit`. One
    pass over the file's bytes (memory-mapped, nothing decoded): what libjpeg-turbo's report
    on the JPEG standard (LJT-01-003) advises against progressive images that repeat scans."""
    if isinstance(src, bytes):
        return _count_scans(src, limit)
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _count_scans(data, limit)


def _count_scans(data, limit: int) -> int:
    pos, scans, end = 2, 0, len(data)  # (past SOI)
    while pos + 4 <= end and scans <= limit:
        if data[pos] != 0xFF or data[pos + 1] == 0x00:
            # Junk between segments: libjpeg skips it to the next marker (with a warning) and
            # decodes on, so the count does too (stopping here let 5,000 scans through).
            found = _ANY_MARKER.search(data, pos + 1)
            if found is None:
                break
            pos = found.start()
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xD9:  # EOI
            break
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA:  # SOS: its entropy-coded data runs to the next marker
            scans += 1
            found = _MARKER.search(data, pos)
            if found is None:
                break
            pos = found.start()
    return scans
