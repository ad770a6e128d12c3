"""Where tandem keeps what it makes for this user (the demo model, the loopback PD secret)."""
from __future__ import annotations

import os
import pathlib


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Resolve the cache directory from the argument, ``$TANDEM_CACHE_DIR`` or the home cache."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    from_environment = os.environ.get("TANDEM_CACHE_DIR")
    if from_environment:
        return pathlib.Path(from_environment)
    return pathlib.Path.home() / ".cache" / "tandem"
