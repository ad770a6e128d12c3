"""The choice of executor for a tensor-parallel engine (``distributed_executor_backend``, vLLM's
name): "mp" starts ranks 1..N-1 as processes of this host (``launcher.py``), "ray" as actors on a
Ray cluster (``ray_executor.py``, imported only when chosen). With one rank the engine core runs
alone, in process, whichever backend is named: nothing is started and Ray is not joined.
"""
from __future__ import annotations

import torch

from tandem.config import EngineConfig
from tandem.engine.ranks.executor import Executor


def start_ranks(config: EngineConfig, device: torch.device) -> Executor:
    """The started executor of a tensor-parallel engine (``tensor_parallel_size`` > 1)."""
    if config.distributed_executor_backend == "ray":
        from tandem.engine.ranks.ray_executor import RayExecutor

        return RayExecutor.start(config, device)
    from tandem.engine.ranks.launcher import MultiprocessExecutor

    return MultiprocessExecutor.start(config, device)
