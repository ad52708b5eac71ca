"""Reading a request body: the size limit, and `Content-Encoding` (gzip, deflate) decoded.

`--max-body-bytes` bounds both what arrives and what it decompresses to: decompression stops
one byte past the limit, so a small compressed body that inflates to gigabytes (a "zip bomb")
costs the server at most the limit in memory and gets a 413. Any other encoding is a 415
rather than bytes passed on to the JSON parser to fail on ("not valid JSON" would be a lie).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

from engine.http.errors import HTTPError

# Content-Encoding value -> zlib window bits (gzip framing; zlib framing, per RFC 9110 §8.4.1.2).
DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
IDENTITY = ("", "identity")


def too_large(limit: int) -> HTTPError:
    # The rest of the body stays unread: close (lingering) after answering.
    return HTTPError(413, f"request body exceeds {limit} bytes", "invalid_request_error",
                     code="request_too_large", headers={"Connection": "close"})  # fmt: skip


def check_encoding(header: str | None) -> str:
    """The body's one content coding, lower-cased ('' for none); else a 415 naming it."""
    coding = (header or "").strip().lower()
    if coding in IDENTITY or coding in DECODERS:
        return coding
    supported = ", ".join(sorted(DECODERS)) + ", identity"
    raise HTTPError(415, f"unsupported Content-Encoding {header!r}; this server decodes "
                    f"{supported}", "invalid_request_error", code="unsupported_content_encoding",
                    headers={"Connection": "close"})  # fmt: skip


async def read_limited(chunks: AsyncIterator[bytes], coding: str, limit: int) -> bytes:
    """The body, decoded, at most `limit` bytes both as sent and decoded (else a 413)."""
    wire = decoded = 0
    parts: list[bytes] = []
    decoder = zlib.decompressobj(DECODERS[coding]) if coding in DECODERS else None
    async for chunk in chunks:
        wire += len(chunk)
        if wire > limit:
            raise too_large(limit)
        if decoder is not None:
            chunk = _inflate(decoder, chunk, limit - decoded, coding)
        decoded += len(chunk)
        if decoded > limit:
            raise too_large(limit)
        parts.append(chunk)
    if decoder is not None:
        tail = _inflate(decoder, b"", limit - decoded, coding, flush=True)
        if len(tail) + decoded > limit:
            raise too_large(limit)
        parts.append(tail)
        if not decoder.eof:
            raise _corrupt(coding, "the compressed data ends early")
    return b"".join(parts)


def _inflate(decoder, data: bytes, room: int, coding: str, flush: bool = False) -> bytes:
    """Decompress at most room + 1 bytes: one past the limit is enough to refuse. (Below that
    bound zlib consumes all its input, so nothing is left pending between chunks.)"""
    try:
        out = decoder.decompress(data, room + 1)
        if flush and len(out) <= room:
            out += decoder.flush()
    except zlib.error as exc:
        raise _corrupt(coding, str(exc)) from None
    if len(out) <= room and decoder.eof and decoder.unused_data:
        raise _corrupt(coding, "data follows the end of the compressed stream")
    return out


def _corrupt(coding: str, detail: str) -> HTTPError:
    return HTTPError(400, f"the body is not valid {coding} data ({detail})",
                     "invalid_request_error")  # fmt: skip
