"""Tensor-parallel ranks: one engine process or Ray actor per rank (per GPU on CUDA).

Every rank runs one ``Worker`` (``worker.py``), rank 0 included; the engine core (rank 0's
process) plans each step (``tandem/engine/step_planner.py``) and its executor hands the plan to
every rank's worker, rank 0's in process.

``executor.py``     the executor interface: in-process (one rank), multiprocess (``launcher.py``), Ray
                    (``ray_executor.py``); ``execute_step``/``execute_draft`` run a plan on every rank,
                    ``sample``/``verify`` a sampling or verification message on rank 0's worker
``start.py``        the one place that chooses an engine's executor (``start_executor``)
``build.py``        how every rank, rank 0 included, builds its shard of the model and the state
``plan.py``         the step message: ``ForwardPlan`` (what every rank's forward pass runs),
                    ``DraftPlan``, and ``StepPlan``, how either reaches ranks 1..N-1 with the page
                    operations rank 0's outbox recorded (``kv/page_operations.py``)
``worker.py``       the ``Worker`` every rank runs (its runner, page executor, tier worker, draft);
                    ranks 1..N-1 build it, then serve rank 0's plans until told to stop
                    (page operations through the same ``PageExecutor`` rank 0 applies them with)
``launcher.py``     the multiprocess executor: starts the workers, watches them, stops them
``ray_executor.py`` the Ray executor: a Ray actor per further rank, across a cluster's nodes
``ray_placement.py`` its placement group: one bundle per rank, rank 0's on the engine's node
``ray_worker.py``   the actor: a worker rank (``worker.py``'s ``serve_plans``) in its bundle

Every rank's page operations (rank 0's as its books emit them, the others' from each plan) run
through one ``PageExecutor`` (``tandem/kv/page_operations.py``; the tiers' kinds through each rank's
``TierWorker``, ``tandem/kv/tiers/tier_worker.py``). The PD operations a plan carries are ``tandem/transfer/rank_operations.py``; each rank's own
transfer agent is ``tandem/disagg/pd_ranks.py``. The primitives (sharded layers, collectives,
the process group) are ``tandem/parallel/``.
"""
