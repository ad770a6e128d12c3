"""Which model directory an entrypoint serves: the one given, or the built-in demo model.

``tandem serve``, ``tandem generate`` and the offline ``LLM`` share this rule, so no model (or
the name ``demo`` where no directory of that name exists) means the same thing everywhere.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

DEMO_MODEL_NAME = "demo"
logger = logging.getLogger("tandem")


def resolve_model(model: Optional[str], flag: str = "--model") -> tuple[str, bool]:
    """Return the model directory to load and whether it is the demo model (built on first use).

    ``flag`` names the argument in the error for a model that is neither a directory nor the
    demo model's name."""
    if model is not None and os.path.isdir(model):
        return model, False
    if model is not None and model != DEMO_MODEL_NAME:
        raise ValueError(f"{flag}: {model!r} is not a directory (a Hugging Face model directory is "
                         f"expected, or '{DEMO_MODEL_NAME}' for the built-in demo model; nothing is downloaded)")
    logger.warning("no model given: using the built-in tiny demo model (random weights, so its text is "
                   "gibberish), built once into the cache directory ($TANDEM_CACHE_DIR, default ~/.cache/tandem)")
    from tandem.tools.demo_model import ensure_demo_model

    path = str(ensure_demo_model())
    logger.info("demo model: %s", path)
    return path, True
