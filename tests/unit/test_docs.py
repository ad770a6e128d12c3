"""The docs cannot go stale: the generated pages (the CLI, metrics and environment references)
match the code, every series has a description, every environment variable is registered, and
every command block of the README and the docs parses — ``tandem`` commands against the real
argument parser, benchmark and script flags against their sources, curl bodies against the
servers' request models, Python blocks as Python. (The curl bodies and the README's SDK example
also run against a live server: test_server_bad_input.py.)"""
import pathlib
import re
import subprocess
import sys

import pytest

from tests.support.docs_blocks import ROOT, blocks, curl_calls, shell_commands, without_environment

# Programs the docs call that are not ours to check (shell built-ins and common tools).
OTHER_PROGRAMS = {"curl", "head", "base64", "chmod", "until", "do", "done", "sleep", "cd", "export", "echo", "cat",
                  "mkdocs", "pip", "grep", "kill", "wait", "nvidia-smi", "ls", "ray", "zip", "mkdir", "git", "tar"}


def test_generated_reference_pages_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def check_tandem_command(arguments: list[str], line: str) -> None:
    from tandem.entrypoints.cli import build_parser

    try:
        build_parser().parse_args(arguments)
    except SystemExit as exited:
        pytest.fail(f"the documented command does not parse ({exited}): {line}")


def check_python_file(arguments: list[str], line: str) -> None:
    """``python FILE FLAGS...``: the file exists and names each flag (benchmarks share common.py's)."""
    path = ROOT / arguments[0]
    assert path.is_file(), f"no such file: {line}"
    check_flags(path, arguments[1:], line)


def check_python_module(arguments: list[str], line: str) -> None:
    """``python -m benchmarks.NAME FLAGS...`` (or a ``tests.support`` module): run from the
    repository root, so the module is a file under it; it names each flag."""
    path = ROOT.joinpath(*arguments[0].split(".")).with_suffix(".py")
    assert path.is_file(), f"no such module: {line}"
    check_flags(path, arguments[1:], line)


def check_flags(path: pathlib.Path, flags: list[str], line: str) -> None:
    source = path.read_text()
    if path.parent.name == "benchmarks":
        source += (ROOT / "benchmarks" / "common.py").read_text()
    for word in flags:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            negated = "--" + flag.removeprefix("--no-")  # a BooleanOptionalAction's --no- form
            assert f'"{flag}"' in source or (flag.startswith("--no-") and f'"{negated}"' in source
                                             and "BooleanOptionalAction" in source), \
                f"{path.name} has no flag {flag}: {line}"


def check_command(words: list[str], line: str) -> bool:
    """Check one documented command; False when it is not one of ours."""
    words = without_environment(words)
    program = words[0]
    if program.endswith("tandem"):
        check_tandem_command(words[1:], line)
    elif program in ("python", "python3") and words[1:3] == ["-m", "tandem.entrypoints.cli"]:
        check_tandem_command(words[3:], line)
    elif program in ("python", "python3") and words[1:2] == ["-m"] and words[2].startswith(("benchmarks.", "tests.")):
        check_python_module(words[2:], line)
    elif program in ("python", "python3", "pytest") and len(words) > 1 and words[1:2] == ["-m"]:
        tests = [word for word in words[3:] if word.startswith("tests/")]
        assert all((ROOT / test.split("::")[0]).exists() for test in tests), line
    elif program == "pytest":
        assert all((ROOT / word.split("::")[0]).exists() for word in words[1:] if word.startswith("tests/")), line
    elif program in ("python", "python3") and words[1].endswith(".py"):
        check_python_file(words[1:], line)
    elif program in ("bash", "sh") and words[1] == "scripts/compare_versions.sh":
        assert len(words) > 4 and words[3].isdigit(), line  # BEFORE ROUNDS COMMAND...
        return check_command(words[4:], line)
    elif program in ("bash", "sh"):
        script = ROOT / words[1]
        assert script.is_file(), line
        text = script.read_text()
        assert all(part in text for part in words[2:]), f"{script.name} has no part named in: {line}"
    elif program == "." or program in OTHER_PROGRAMS or program.startswith(".venv"):
        return False
    else:
        pytest.fail(f"a documented command this test does not know how to check: {line}")
    return True


def test_every_documented_command_parses():
    checked = 0
    for source, text in blocks("bash"):
        for words in shell_commands(text):
            checked += check_command(words, f"{source.relative_to(ROOT)}: {' '.join(words)}")
    assert checked >= 60, checked  # the README's and the pages' commands, not a parser that found nothing


def test_documented_tandem_commands_include_the_readme_ones():
    """The README's two commands are among what the test above parsed (it reads the README)."""
    readme = [" ".join(words) for _, text in blocks("bash") for words in shell_commands(text)]
    assert "bash scripts/setup.sh" in readme and ".venv/bin/tandem serve --port 8000" in readme
    assert "python -m pytest -m not gpu -q -n 2 --dist loadfile" in readme


def test_documented_curl_bodies_are_valid_requests():
    from tandem.entrypoints.router.validation import REQUEST_MODELS

    calls = [call for call in curl_calls() if call.body is not None]
    assert len(calls) >= 4
    for call in calls:
        REQUEST_MODELS[call.path].model_validate(call.body)


def test_python_blocks_compile():
    sources = blocks("python")
    assert len(sources) >= 5
    for path, text in sources:
        compile(text, str(path), "exec")


def test_links_between_pages_use_relative_paths():
    """The README links into docs/ by relative path (GitHub renders them); every one exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert targets
    for target in targets:
        assert not target.startswith("http") and (ROOT / target).exists(), target
    assert len(readme.splitlines()) <= 150


def test_every_environment_variable_the_package_reads_is_registered():
    """``tandem/environment.py`` (the docs' environment page) names each ``TANDEM_`` variable of
    the package's source, and nothing the source never mentions; a name ending in ``_`` is a
    family (``TANDEM_ALLREDUCE_*``) and needs a registered member."""
    from tandem.environment import AUDIENCES, VARIABLES

    registered = {variable.name for variable in VARIABLES}
    assert len(registered) == len(VARIABLES), "a variable registered twice"
    assert all(variable.audience in AUDIENCES for variable in VARIABLES)
    mentioned: set[str] = set()
    for path in (ROOT / "tandem").rglob("*.py"):
        if path.name != "environment.py":
            mentioned.update(re.findall(r"\bTANDEM_[A-Z0-9_]+", path.read_text()))
    families = {name for name in mentioned if name.endswith("_")}
    unregistered = sorted(mentioned - families - registered)
    assert not unregistered, f"register these in tandem/environment.py: {unregistered}"
    assert all(any(name.startswith(family) for name in registered) for family in families), families
    assert not sorted(registered - mentioned), f"registered but read nowhere: {sorted(registered - mentioned)}"
