"""Importable under its former name for test files written before tests/support/ (docs/contributing.md);
new code imports ``tests.support.tool_calling``."""
from tests.support.tool_calling import *  # noqa: F401,F403
