"""The built-in demo model: built once with :func:`tandem.tools.make_model.make_model` into a
cache directory named after everything that shapes it, and shared by concurrent builders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile

from tandem.cache_dir import cache_root
from tandem.tools import make_model as builder
from tandem.tools import made_weights, tokenizer_maker

logger = logging.getLogger("tandem.tools.make_model")

def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the directory of the built-in demo model, building it on first use.

    The directory lives in ``cache_dir``, else ``$TANDEM_CACHE_DIR``, else
    ``~/.cache/tandem``, under a name that hashes the builder and the demo options.
    Safe against concurrent builders: each builds in its own temporary directory and renames
    it into place atomically; a builder that loses the race discards its copy.
    """
    root = cache_root(cache_dir)
    final = root / _demo_model_name()
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=root))
    try:
        options = dict(builder.DEMO_MODEL_OPTIONS)
        builder.make_model(options.pop("arch"), staging, **options)
        staging.chmod(0o755)  # mkdtemp makes it private to this user
        _publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _demo_model_name() -> str:
    """Return ``demo-<arch>-<hash>``.

    The hash covers the demo options, the builder modules' sources and the transformers and
    tokenizers versions, so any change to how models are built gives a new directory.
    """
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    digest.update(json.dumps(dict(builder.DEMO_MODEL_OPTIONS), sort_keys=True).encode())
    for module in (builder, tokenizer_maker, made_weights):
        digest.update(pathlib.Path(module.__file__).read_bytes())
    digest.update(f"{transformers.__version__} {tokenizers.__version__}".encode())
    return f"demo-{builder.DEMO_MODEL_OPTIONS['arch']}-{digest.hexdigest()[:12]}"


def _publish(staging: pathlib.Path, final: pathlib.Path) -> None:
    """Atomically rename ``staging`` to ``final``; if another builder won, keep theirs."""
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
        logger.info("demo model already built by another process: %s", final)
