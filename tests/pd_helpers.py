"""Importable under its former name for test files written before tests/support/ (docs/contributing.md);
new code imports ``tests.support.pd``."""
from tests.support.pd import *  # noqa: F401,F403
