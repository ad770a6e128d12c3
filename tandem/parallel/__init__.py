"""Tensor parallelism: one engine process per rank (per GPU on CUDA).

``shard.py``     a rank's place in the group and its collectives (what sharded layers call)
``layers.py``    column/row-parallel linear layers, vocabulary-parallel embedding and LM head
``group.py``     process-group setup (a TCP store on 127.0.0.1; gloo on CPU, NCCL on CUDA)
``plan.py``      the step plan rank 0 broadcasts (the model runner's inputs + page operations)
``worker.py``    a worker rank: builds its shard, then executes rank 0's plans until told to stop
``launcher.py``  rank 0's side: starts the workers, watches them, stops them
``pd_ranks.py``  PD between tensor-parallel engines: each rank's own transfer agent, rank i to rank i
``transfer_plan.py`` the PD operations a plan carries to the workers, and their answers
"""
