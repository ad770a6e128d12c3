"""Which executor runs an engine's ranks: the one place that chooses."""
from __future__ import annotations

import torch

from tandem.config import EngineConfig
from tandem.engine.ranks.executor import Executor, InProcessExecutor
from tandem.engine.ranks.launcher import MultiprocessExecutor


def start_executor(config: EngineConfig, device: torch.device) -> Executor:
    """One rank: in process. Several: a worker process per further rank on this host."""
    if config.tensor_parallel_size == 1:
        return InProcessExecutor.start(config, device)
    return MultiprocessExecutor.start(config, device)
