"""The command blocks of the README and the docs pages, read the way a reader copies them: fenced
``bash`` and ``python`` blocks, shell lines joined across ``\\`` and split into commands at
``&&``, ``;``, ``|`` and ``&``; ``curl`` calls with their URL path and JSON body."""
from __future__ import annotations

import json
import pathlib
import re
import shlex
from dataclasses import dataclass
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(language: str) -> list[tuple[pathlib.Path, str]]:
    """Every fenced block of ``language`` in the README and the docs: (file, text)."""
    return [(path, match.group(2)) for path in documents() for match in FENCE.finditer(path.read_text())
            if match.group(1) == language]


def shell_commands(text: str) -> list[list[str]]:
    """Each command of a bash block as its words (comments dropped, continuations joined)."""
    joined = re.sub(r"\\\n", " ", text)
    commands = []
    for line in logical_lines(joined):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                commands.append(words)
                words = []
            else:
                words.append(token)
        commands.append(words)
    return [words for words in commands if words]


def logical_lines(text: str) -> list[str]:
    """Lines, a quoted string that spans lines kept whole (a JSON body over two lines)."""
    lines, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quotation: the next line continues it
            continue
        lines.append(pending)
        pending = ""
    if pending:
        raise ValueError(f"unclosed quotation in a documented command: {pending}")
    return lines


def without_environment(words: list[str]) -> list[str]:
    """The command after its ``NAME=value`` prefixes."""
    index = 0
    while index < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[index]):
        index += 1
    return words[index:]


@dataclass
class CurlCall:
    source: pathlib.Path
    path: str
    body: Optional[dict]


def curl_calls() -> list[CurlCall]:
    """Every documented ``curl`` against a tandem server or router: its path and JSON body."""
    calls = []
    for source, text in blocks("bash"):
        for words in shell_commands(text):
            words = without_environment(words)
            if not words or words[0] != "curl":
                continue
            url = next(word for word in words[1:] if word.startswith("http"))
            data = words[words.index("-d") + 1] if "-d" in words else None
            calls.append(CurlCall(source, re.sub(r"^https?://[^/]+", "", url), json.loads(data) if data else None))
    return calls
