"""Keys of stored pages: the chain hash of a page's tokens under its ancestors (a prefix-cache
node's identity in every tier) and the fingerprint of the layout a page was written under."""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import numpy as np


def layout_fingerprint(parts: Iterable[object]) -> str:
    """A stable digest (hex) of the parts naming a layout: model name, dtype, page size, the
    ordered buffer list. Each part is written as its ``repr`` (dicts with sorted keys, sets
    sorted), which must not depend on the process: a repr with an object address raises."""
    def canon(obj: object) -> str:
        if isinstance(obj, (list, tuple)):
            return type(obj).__name__ + "(" + ",".join(canon(o) for o in obj) + ")"
        if isinstance(obj, dict):
            return "dict(" + ",".join(sorted(f"{canon(k)}:{canon(v)}" for k, v in obj.items())) + ")"
        if isinstance(obj, (set, frozenset)):
            return "set(" + ",".join(sorted(canon(o) for o in obj)) + ")"
        text = repr(obj)
        if " at 0x" in text:
            raise TypeError(f"layout_fingerprint: {text} has no stable repr across processes")
        return text
    text = "tandem-layout-v1\x1f" + "\x1f".join(canon(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def chain_hash(parent: bytes, tokens: Sequence[int], *, extra: bytes = b"") -> bytes:
    """16-byte blake2b of the parent's hash (``b""`` for the root), the page's token ids as
    int64 little-endian, and optional ``extra`` bytes (a salt such as an adapter id). Lengths
    are mixed in, so no two (parent, tokens, extra) triples share an input."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    h = hashlib.blake2b(digest_size=16, person=b"tandem-chain-v1")
    for part in (bytes(parent), extra, data):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()
