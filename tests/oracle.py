"""Importable under its former name for test files written before tests/support/ (docs/contributing.md);
new code imports ``tests.support.oracle``."""
from tests.support.oracle import *  # noqa: F401,F403
