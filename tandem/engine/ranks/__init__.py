"""Tensor-parallel ranks: one engine process per rank (per GPU on CUDA).

``executor.py``     the executor interface: in-process (one rank), multiprocess (``launcher.py``)
``start.py``        the one place that chooses an engine's executor (``start_executor``)
``build.py``        how every rank, rank 0 included, builds its shard of the model and the state
``plan.py``         the step plan rank 0 broadcasts (the model runner's inputs + page operations)
``worker.py``       a worker rank: builds its shard, then executes rank 0's plans until told to stop
``launcher.py``     the multiprocess executor: starts the workers, watches them, stops them
``worker_tiers.py`` a worker rank's host and disk tiers, replaying rank 0's tier operations

The PD operations a plan carries are ``tandem/transfer/rank_operations.py``; each rank's own
transfer agent is ``tandem/disagg/pd_ranks.py``. The primitives (sharded layers, collectives,
the process group) are ``tandem/parallel/``.
"""
