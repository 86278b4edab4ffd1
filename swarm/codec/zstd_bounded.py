"""zstd decompression of untrusted bytes with a hard output cap.

``ZstdDecompressor.decompress(data, max_output_size=N)`` is not a cap: when the
frame header declares a content size, zstandard (0.25) trusts the header and
allocates that many bytes, so a flipped header byte or a crafted 133-byte frame
declaring 8 TiB ends in ``MemoryError``. Every zstd call on bytes from the
network or disk goes through ``decompress_bounded`` instead, which

1. parses the frame header and refuses a declared size above ``limit`` (or a
   header that cannot be parsed) before anything is allocated; a frame whose
   declared size passes is decoded in one call (zstd refuses a frame whose
   content overruns its declared size, so the allocation is the bound);
2. streams a frame that declares no size through ``decompressobj`` in small
   input steps, so the output grows only as far as the input really encodes
   (at most ~128 MiB past ``limit`` in one step, at zstd's ~32,768:1 ceiling)
   and is refused as soon as it passes ``limit``.

``limit`` is further capped by ``HARD_CEILING``. Errors are the caller's
one-line format error, built by ``error(message)``.
"""

from __future__ import annotations

from collections.abc import Callable

import zstandard

HARD_CEILING = 1 << 36  # 64 GiB: no single zstd frame of ours may decode to more
FEED = 4096  # input bytes per step when the frame declares no size


def decompress_bounded(data: bytes | memoryview, limit: int, what: str,
                       error: Callable[[str], Exception], *, exact: bool = True) -> bytes:
    """Decompress one zstd frame of at most ``limit`` bytes (exactly ``limit`` if ``exact``)."""
    limit = min(limit, HARD_CEILING)
    data = memoryview(data)  # zstandard reads any buffer: no copy of the input
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as exc:
        raise error(f"{what}: corrupt compressed data ({exc})") from None
    try:
        if declared in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
            out = _stream(data, limit, what, error)
        elif declared > limit or (exact and declared != limit):
            raise error(f"{what}: compressed frame declares {declared} bytes, "
                        f"{'expected' if exact else 'at most'} {limit}")
        else:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise error(f"{what}: corrupt compressed data ({exc})") from None
    if len(out) > limit or (exact and len(out) != limit):
        raise error(f"{what}: decompressed {len(out)} bytes, expected {limit}")
    return out


def _stream(data: memoryview, limit: int, what: str, error: Callable[[str], Exception]) -> bytes:
    dobj = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    pos = 0
    while pos < len(data) and not dobj.eof:
        out += dobj.decompress(data[pos:pos + FEED])
        pos += FEED
        if len(out) > limit:
            raise error(f"{what}: decompresses to more than {limit} bytes")
    if not dobj.eof:
        raise error(f"{what}: compressed data truncated")
    if dobj.unused_data or pos < len(data):
        raise error(f"{what}: trailing bytes after the compressed frame")
    return bytes(out)
