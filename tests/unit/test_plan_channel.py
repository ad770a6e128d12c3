"""The plan channel over a real gloo group of two ranks (threads of this process): rank 0's send
returns before the other rank takes the plan, rank 0 runs at most one plan ahead, and every plan
arrives whole and in order."""
import datetime
import threading
import time

import numpy as np
import torch.distributed as dist

from tandem.engine.ranks.plan import STEP, STOP, Array, PlanChannel, StepPlan
from tandem.parallel.group import LOOPBACK, _gloo, open_store

TIMEOUT = datetime.timedelta(seconds=30)


def test_send_leaves_the_plan_in_flight_and_plans_arrive_in_order():
    store, port = open_store(2)
    groups = {}

    def join(rank):
        rank_store = store if rank == 0 else dist.TCPStore(LOOPBACK, port, 2, False, timeout=TIMEOUT)
        groups[rank] = (_gloo(rank_store, "control", rank, 2, TIMEOUT, LOOPBACK), rank_store)

    joiner = threading.Thread(target=join, args=(1,))
    joiner.start()
    join(0)
    joiner.join()
    sender, receiver = PlanChannel(groups[0][0], 0), PlanChannel(groups[1][0], 1)
    table = np.arange(3 * 70_000, dtype=np.int32).reshape(3, 70_000)  # a payload larger than a socket buffer
    plans = [StepPlan(STEP, num_decode=index, page_tables=[Array.of(table + index)]) for index in range(3)]
    plans.append(StepPlan(STOP))
    received, may_receive = [], threading.Event()

    def serve():
        may_receive.wait()
        while True:
            received.append(receiver.receive())
            if received[-1].kind == STOP:
                return

    rank1 = threading.Thread(target=serve)
    rank1.start()
    started = time.monotonic()
    sender.send(plans[0])  # nobody receives yet: it must not wait
    assert time.monotonic() - started < 5 and len(sender.in_flight) == 2
    may_receive.set()
    for plan in plans[1:]:
        sender.send(plan)  # waits for the plan before it to be taken
    sender.settle()
    assert sender.in_flight == []
    rank1.join(timeout=30)
    assert not rank1.is_alive()
    assert [plan.kind for plan in received] == [STEP, STEP, STEP, STOP]
    for index, plan in enumerate(received[:3]):
        assert plan.num_decode == index
        assert np.array_equal(plan.page_tables[0].value(), table + index)
