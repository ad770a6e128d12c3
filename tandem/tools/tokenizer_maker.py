"""The tokenizer every made model carries: a byte-level BPE trained here, deterministically, on a
made-up English-like, numeric and code-like corpus (nothing is downloaded), with ChatML's
special tokens and chat template; or the files of another made model copied over.
"""

from __future__ import annotations

import logging
import os
import pathlib
import random
import shutil
from collections.abc import Iterator

logger = logging.getLogger("tandem.tools.make_model")

END_OF_TEXT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML; message content is rendered verbatim, any role name is accepted.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer rebuilds this one on load).
PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Byte-level BPE needs the 256 byte symbols, the special tokens and room for some merges.
MINIMUM_VOCAB_SIZE = 320


def prepare_tokenizer(
    out_path: pathlib.Path,
    vocab_size: int,
    max_position_embeddings: int,
    tokenizer_dir: str | os.PathLike | None,
):
    """Train (or copy from ``tokenizer_dir``) the tokenizer into ``out_path`` and return it loaded."""
    import transformers

    if tokenizer_dir is None:
        train_tokenizer(vocab_size, max_position_embeddings).save_pretrained(out_path)
    else:
        _copy_tokenizer_files(pathlib.Path(tokenizer_dir), out_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_path)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size {vocab_size}")
    return tokenizer


def _copy_tokenizer_files(source: pathlib.Path, destination: pathlib.Path) -> None:
    """Copy the tokenizer files of a model directory made by :func:`make_model`."""
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {source}")
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
    logger.info("copied the tokenizer from %s", source)


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """Return the ids the config and generation config must carry."""
    return {
        "eos_token_id": tokenizer.convert_tokens_to_ids(END_OF_TEXT_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "bos_token_id": None,
        "im_end_token_id": tokenizer.convert_tokens_to_ids(IM_END_TOKEN),
    }


def train_tokenizer(vocab_size: int, model_max_length: int = 4096):
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens on :func:`training_corpus`.

    The corpus fills vocabularies up to about 2,000 tokens; a larger ``vocab_size`` leaves the
    top ids unused by the tokenizer (the model still has rows for them).

    Deterministic. Special tokens take ids 0..3 in the order of ``SPECIAL_TOKENS``; the eos
    token is ``<|endoftext|>``, the pad token ``<|pad|>``, there is no bos token, and the
    ChatML ``chat_template`` is attached. Returns a ``PreTrainedTokenizerFast``.

    The normalizer and pre-tokenizer are exactly those transformers' ``Qwen2Tokenizer``
    rebuilds (NFC, Qwen's split regex, byte-level), so whichever class ``AutoTokenizer``
    picks for the model type encodes the same ids as ``tokenizer.json`` read directly.
    """
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def training_corpus(num_lines: int = 8000, seed: int = 1234) -> Iterator[str]:
    """Yield a deterministic English-like, numeric and code-like corpus of ``num_lines`` lines."""
    generator = random.Random(seed)
    makers = (_sentence, _sentence, _sentence, _named_sentence, _numbers_line, _code_line, _dialogue_line)
    for _ in range(num_lines):
        yield generator.choice(makers)(generator)


_SUBJECTS = (
    "the cat", "a small dog", "my friend", "the teacher", "our team", "the server", "a model", "she", "he",
    "they", "the old man", "every student", "the young woman", "a farmer", "the pilot", "your brother",
    "the committee", "a quiet child", "the engineer", "some people", "the doctor", "this program",
)
_VERBS = (
    "sees", "likes", "reads", "writes", "builds", "finds", "moves", "answers", "sends", "keeps", "opens",
    "counts", "carries", "paints", "remembers", "follows", "explains", "measures", "repairs", "watches",
    "cleans", "borrows", "describes", "collects", "compares", "visits", "loads", "schedules", "returns",
)
_ADJECTIVES = (
    "red", "new", "old", "long", "short", "bright", "dark", "heavy", "light", "quiet", "famous", "simple",
    "strange", "careful", "green", "empty", "warm", "cold", "tiny", "large", "broken", "useful", "hidden",
)
_NOUNS = (
    "book", "letter", "river", "bread", "answer", "house", "car", "token", "garden", "story", "cache",
    "apple", "window", "mountain", "table", "message", "machine", "bridge", "picture", "question", "road",
    "forest", "kitchen", "number", "request", "village", "engine", "pencil", "island", "market", "school",
)
_ENDINGS = (
    "today", "in the morning", "at night", "with care", "very quickly", "again", "before lunch",
    "after the rain", "near the station", "every day", "during the winter", "on the weekend",
    "without a word", "for a long time", "once more", "by the window", "at the end of the week",
)
_SYLLABLES = (
    "ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "an", "is", "qu", "bre", "nix", "ol", "ta", "zu",
    "ber", "chi", "el", "fon", "gra", "hu", "jo", "lin", "mar", "ne", "pi", "ros", "sto", "ul", "wen", "ya",
)
_PUNCTUATION = (".", ".", ".", "!", "?", ";", ",", "...", ":")
_IDENTIFIERS = (
    "value", "count", "items", "result", "index", "total", "name", "buffer", "request", "token", "offset",
    "length", "config", "batch", "state", "output", "prompt", "block", "size", "cursor",
)
_CODE_TEMPLATES = (
    "def {a}({b}):\n    return {b} + {n}",
    "for {a} in range({n}):\n    {b}.append({a})",
    "if {a} > {n}:\n    print(\"{b}\", {a})",
    "{a} = [{n}, {m}, {n} * {m}]",
    "class {A}:\n    def __init__(self, {b}):\n        self.{b} = {b}",
    "{{\"{a}\": {n}, \"{b}\": [{m}, {n}]}}",
    "while {a} < {n}: {a} += 1  # {b}",
    "{a}_{b} = {a}.get(\"{b}\", {m}) or []",
    "assert len({a}) == {n}, f\"bad {b}: {{{a}}}\"",
    "return {{\"{a}\": {a}, \"{b}\": {b}[{n}:{m}]}}",
)


def _noun_phrase(generator: random.Random) -> str:
    """Return a noun phrase such as ``the heavy bridge``."""
    article = generator.choice(("the", "a", "my", "this", "some", "every", "our"))
    if generator.random() < 0.5:
        return f"{article} {generator.choice(_ADJECTIVES)} {generator.choice(_NOUNS)}"
    return f"{article} {generator.choice(_NOUNS)}"


def _sentence(generator: random.Random) -> str:
    """Return one English-like sentence."""
    words = [generator.choice(_SUBJECTS), generator.choice(_VERBS), _noun_phrase(generator)]
    if generator.random() < 0.6:
        words.append(generator.choice(_ENDINGS))
    text = " ".join(words) + generator.choice(_PUNCTUATION)
    return text[0].upper() + text[1:] if generator.random() < 0.7 else text


def _made_up_name(generator: random.Random) -> str:
    """Return a capitalised made-up name of two or three syllables."""
    name = "".join(generator.choice(_SYLLABLES) for _ in range(generator.randint(2, 3)))
    return name.capitalize()


def _named_sentence(generator: random.Random) -> str:
    """Return a sentence about made-up people and places."""
    return (
        f"{_made_up_name(generator)} {generator.choice(_VERBS)} {_noun_phrase(generator)} "
        f"in {_made_up_name(generator)}{generator.choice(_PUNCTUATION)}"
    )


def _numbers_line(generator: random.Random) -> str:
    """Return a line of integers, decimals and arithmetic."""
    first, second = generator.randint(0, 9999), generator.randint(0, 999)
    return (
        f"{first} + {second} = {first + second}, {generator.random():.3f} and "
        f"{generator.randint(1, 12)}/{generator.randint(1, 31)}/{generator.randint(1990, 2030)}"
    )


def _code_line(generator: random.Random) -> str:
    """Return a small code-like snippet."""
    first, second = generator.sample(_IDENTIFIERS, 2)
    template = generator.choice(_CODE_TEMPLATES)
    numbers = {"n": generator.randint(0, 99), "m": generator.randint(0, 99)}
    return template.format(a=first, b=second, A=first.title(), **numbers)


def _dialogue_line(generator: random.Random) -> str:
    """Return a quoted exchange with mixed punctuation."""
    return f"\"{_sentence(generator)}\" asked {_made_up_name(generator)} - \"{_sentence(generator)}\""
