"""Full attention: every past token is read at every step, so every page is kept and a prefix
hit of ``k`` pages is usable as is."""
from __future__ import annotations

from tandem.kv.managers.base import StateManager


class FullAttentionManager(StateManager):
    pass
