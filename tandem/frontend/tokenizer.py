"""Loading the Hugging Face fast tokenizer of a model directory (nothing is downloaded)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

UNLIMITED_LENGTH = int(1e30)  # what transformers itself sets for a tokenizer without a limit


def load_tokenizer(path: Union[str, Path]):
    """Return the fast (Rust-backed) tokenizer stored in the model directory ``path``.

    Only local files are read. Raises ``OSError`` when the directory holds no tokenizer. Its
    ``model_max_length`` is lifted: tandem checks lengths itself (``max_model_len``, an error
    naming the field) and never truncates, so the checkpoint's value would only make
    ``transformers`` log a warning about long prompts.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), use_fast=True, local_files_only=True,
                                              trust_remote_code=False)
    tokenizer.model_max_length = UNLIMITED_LENGTH
    return tokenizer


def eos_token_ids(tokenizer) -> list[int]:
    """The tokenizer's end-of-sequence token ids (possibly empty)."""
    token_id: Optional[int] = getattr(tokenizer, "eos_token_id", None)
    return [] if token_id is None else [int(token_id)]


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                        chat_template: Optional[str] = None, **template_kwargs) -> str:
    """Render ``messages`` with the tokenizer's chat template (or ``chat_template``) to text.

    Raises ``ValueError`` when the tokenizer has no chat template and none was given.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages: the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=template, **template_kwargs)
