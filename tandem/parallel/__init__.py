"""Tensor parallelism's primitives: what a sharded model and its ranks are built from.

``shard.py``     a rank's place in the group and its collectives (what sharded layers call)
``layers.py``    column/row-parallel linear layers, vocabulary-parallel embedding and LM head
``group.py``     process-group setup (a TCP store, 127.0.0.1 on one host; gloo on CPU, NCCL on CUDA)
``graphs.py``    CUDA graph capture in step on every rank

Running the ranks is the engine's (``tandem/engine/ranks/``); PD between tensor-parallel
engines is disaggregation's (``tandem/disagg/pd_ranks.py``).
"""
