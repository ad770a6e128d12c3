"""Which executor runs an engine's ranks (``distributed_executor_backend``, vLLM's name): the
one place that chooses."""
from __future__ import annotations

import torch

from tandem.config import EngineConfig
from tandem.engine.ranks.executor import Executor, InProcessExecutor
from tandem.engine.ranks.launcher import MultiprocessExecutor


def start_executor(config: EngineConfig, device: torch.device) -> Executor:
    """One rank: in process, whichever ``distributed_executor_backend`` is named (nothing is
    started, Ray is not joined). Several: ``"mp"``, a worker process per further rank on this
    host; ``"ray"``, an actor per further rank on a Ray cluster (``ray_executor.py``, imported
    only when chosen)."""
    if config.tensor_parallel_size == 1:
        return InProcessExecutor.start(config, device)
    if config.distributed_executor_backend == "ray":
        from tandem.engine.ranks.ray_executor import RayExecutor

        return RayExecutor.start(config, device)
    return MultiprocessExecutor.start(config, device)
