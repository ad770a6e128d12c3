"""The disk tier's page files (their layout: ``disk_store.py``): the header written before a
payload and the checks of a file read back, exact reads and writes, the payload check, and the
rejection record (one reason and its detail) the store counts and logs."""
from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

MAGIC = b"TNDMPAGE"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHIQ32sI")  # everything before the header crc
HEADER_SIZE = _FIXED.size + 4          # 64 bytes, then the key
ORIGINS = ("unknown", "prefill", "decode", "colocated")  # header field 3, by index


@dataclass
class Rejected:
    reason: str
    detail: str


def check_payload_tensor(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.device.type != "cpu" \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous uint8 CPU tensor")


def read_exact(f, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def readinto_exact(f, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        view = view[n:]


def page_header(key: bytes, data: memoryview, origin: str, digest: bytes) -> bytes:
    """The header and key written before ``data`` (``origin`` one of ``ORIGINS``)."""
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), ORIGINS.index(origin), len(data), digest, zlib.crc32(data))
    return fixed + struct.pack("<I", zlib.crc32(key, zlib.crc32(fixed))) + key


def read_page(f, key: bytes, digest: bytes, out: Optional[torch.Tensor]):
    """A page file's payload (into ``out`` when given) and its origin, after every check of
    its header, key, length and checksum; else ``Rejected``."""
    head = read_exact(f, HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        return Rejected("truncated", f"{len(head)}-byte header")
    magic, version, key_len, origin, payload_len, file_digest, payload_crc = _FIXED.unpack_from(head)
    if magic != MAGIC:
        return Rejected("header", "bad magic")
    file_key = read_exact(f, key_len)
    if len(file_key) < key_len:
        return Rejected("truncated", "short key")
    (header_crc,) = struct.unpack_from("<I", head, _FIXED.size)
    if zlib.crc32(file_key, zlib.crc32(head[:_FIXED.size])) != header_crc:
        return Rejected("header", "header checksum mismatch")
    if version != FORMAT_VERSION:
        return Rejected("version", f"format version {version}, expected {FORMAT_VERSION}")
    if file_digest != digest:
        return Rejected("foreign", "written for another model or layout (fingerprint differs)")
    if file_key != key:
        return Rejected("foreign", f"holds key {file_key.hex()}, expected {key.hex()}")
    size = os.fstat(f.fileno()).st_size
    expected = HEADER_SIZE + key_len + payload_len
    if size != expected:
        return Rejected("truncated" if size < expected else "length", f"{size} bytes, header says {expected}")
    if out is not None and out.numel() != payload_len:
        return Rejected("length", f"payload of {payload_len} bytes, caller expects {out.numel()}")
    buf = bytearray(payload_len) if out is None else out.view(-1).numpy()
    view = memoryview(buf).cast("B")
    if readinto_exact(f, view) < payload_len:
        return Rejected("truncated", "short payload")
    if zlib.crc32(view) != payload_crc:
        return Rejected("checksum", "payload checksum mismatch")
    return view, (ORIGINS[origin] if origin < len(ORIGINS) else "unknown")
