"""Compiling grammar sources against the model's tokenizer, off the engine loop.

Owner: the engine core (one per engine). ``submit`` returns a future at once; compilations run
on a small thread pool (xgrammar compiles in C++ without the interpreter lock), so running
requests keep stepping while a new request's grammar compiles. Results are cached per source
(the tokenizer is fixed per engine, so the key is the source alone); a cached future — done or
still compiling — is shared by every request that asks for the same source.

The tokenizer info is built once: from the Hugging Face tokenizer, with the vocabulary size of
the model's LM head (which may exceed the tokenizer's: ids past the tokenizer's are never
allowed) and the model's end-of-sequence ids as the tokens that end a grammar.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from tandem.structured.source import GrammarSource, json_schema_ebnf

MAX_CACHED_GRAMMARS = 1024
COMPILE_THREADS = 2


@dataclass
class CompileStats:
    num_compiled: int = 0
    compile_seconds: float = 0.0  # summed over compilations
    num_cache_hits: int = 0


class GrammarCompilerPool:
    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_threads: int = COMPILE_THREADS) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, use_fast=True, local_files_only=True,
                                                  trust_remote_code=False)
        self.vocab_size = vocab_size
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[GrammarSource, Future] = collections.OrderedDict()
        self._lock = threading.Lock()  # the stats are written by the pool's threads
        self.stats = CompileStats()

    def cached(self, source: GrammarSource) -> Optional[Future]:
        """The cached compilation of ``source`` (done, or still compiling), counted as a hit;
        ``None`` when there is none or it failed (a new ``submit`` tries again)."""
        cached = self._cache.get(source)
        if cached is None or (cached.done() and cached.exception() is not None):
            return None
        self._cache.move_to_end(source)
        self.stats.num_cache_hits += 1
        return cached

    def submit(self, source: GrammarSource) -> Future:
        """The compiled grammar of ``source``, as a future (done at once on a cache hit)."""
        cached = self.cached(source)
        if cached is not None:
            return cached
        future = self._executor.submit(self._compile, source)
        self._cache[source] = future
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def _compile(self, source: GrammarSource):
        start = time.perf_counter()
        if source.kind == "json":
            compiled = self._compiler.compile_grammar(json_schema_ebnf(source))
        elif source.kind == "regex":
            compiled = self._compiler.compile_regex(source.text)
        else:
            compiled = self._compiler.compile_grammar(source.text)
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
