"""Importable under its former name for test files written before tests/support/ (docs/contributing.md);
new code imports ``tests.support.state_checks``."""
from tests.support.state_checks import *  # noqa: F401,F403
