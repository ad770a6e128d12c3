"""Structured outputs: a request's output constrained by a grammar (JSON Schema, any JSON
object, regex, EBNF, a choice of strings), enforced with ``xgrammar``.

- ``source.py``: what a ``StructuredOutputsParams`` asks for, as one cache key, and its syntax
  check (no tokenizer needed: the frontend answers 400 before anything is submitted).
- ``compiler.py``: compiles sources against the model's tokenizer on a thread pool, cached.
- ``matcher.py``: a sequence's matcher, kept level with its output tokens.
- ``bitmask.py``: the per-row token bitmask, filled on the host and applied to logits.
"""
