"""The parts of ``tandem deploy`` that need no Ray (fast): the autoscaler's hysteresis, a router
whose servers come and go through a membership source, the serve flags passed on to replicas,
and the deploy command's checks of its flags."""
import asyncio
import json

import pytest

from tandem.entrypoints.cli import build_parser
from tandem.entrypoints.deploy.autoscale import AutoscaleConfig, AutoscalePolicy
from tandem.entrypoints.deploy.cli import role_sizes
from tandem.entrypoints.deploy.serve_flags import serve_arguments
from tandem.entrypoints.router.membership import LoadReport, Member, Membership
from tandem.entrypoints.router.routing import Router


# -- autoscaling ---------------------------------------------------------------------------------------
def test_autoscaler_grows_and_shrinks_with_hysteresis():
    policy = AutoscalePolicy(AutoscaleConfig(scale_out_in_flight=2, scale_in_in_flight=0.5, scale_out_after=1.0,
                                             scale_in_after=3.0, ttft_target=0.2))
    decide = lambda replicas, in_flight, now, ttft=None: policy.desired("prefill", replicas, 1, 3, in_flight, ttft, now)
    assert decide(1, 5, 0.0) == 1  # overloaded, not yet for long enough
    assert decide(1, 5, 0.5) == 1
    assert decide(1, 1, 0.9) == 1  # back in the band: the clock stops
    assert decide(1, 5, 1.0) == 1
    assert decide(1, 5, 2.0) == 2  # overloaded for 1 s: grow by one
    assert decide(2, 10, 2.5) == 2  # a change restarts the clocks (the cooldown)
    assert decide(2, 10, 3.5) == 3
    assert decide(3, 100, 10.0) == 3 and decide(3, 100, 20.0) == 3  # at the maximum
    assert decide(3, 1, 21.0) == 3  # 1/3 < 0.5: idle, not yet for long enough
    assert decide(3, 1, 24.0) == 2
    assert decide(2, 0, 24.5) == 2 and decide(2, 0, 27.5) == 1
    assert decide(1, 0, 40.0) == 1 and decide(1, 0, 50.0) == 1  # at the minimum
    assert decide(1, 0, 51.0, ttft=0.5) == 1 and decide(1, 0, 52.0, ttft=0.5) == 2  # slow first tokens
    assert policy.desired("decode", 1, 1, 3, 0, 0.5, 60.0) == 1  # TTFT drives prefill, not decode
    assert policy.desired("decode", 1, 1, 3, 0, 0.5, 70.0) == 1
    with pytest.raises(ValueError, match="scale_in_in_flight"):
        AutoscaleConfig(scale_out_in_flight=1, scale_in_in_flight=1)


# -- a router whose membership changes -----------------------------------------------------------------
class FakeServers:
    """The router's HTTP client towards colocated servers that answer /pd/info and /v1/models."""

    def __init__(self):
        self.up: set[str] = set()

    async def get(self, url: str, timeout: float):
        base, _, path = url.partition("/pd/info") if "/pd/info" in url else url.partition("/v1/models")
        if base not in self.up:
            raise asyncio.TimeoutError()
        if url.endswith("/pd/info"):
            return 200, json.dumps({"role": "colocated", "served_model_names": ["tiny"]}).encode()
        return 200, b"{}"

    async def close(self):
        pass


class ListSource:
    roles = ("colocated",)

    def __init__(self):
        self.membership = Membership(0)
        self.acknowledged: list[tuple[int, LoadReport]] = []

    async def members(self):
        return self.membership

    async def acknowledge(self, version, report):
        self.acknowledged.append((version, report))

    async def close(self):
        pass


def test_router_follows_its_membership_source():
    servers, source = FakeServers(), ListSource()
    router = Router([], [], client=servers, membership=source, health_interval=60)
    servers.up = {"http://a", "http://b"}
    source.membership = Membership(1, (Member("colocated-0", "colocated", "http://a"),
                                       Member("colocated-1", "colocated", "http://b/")))

    async def scenario():
        await router.watcher.first_sync(timeout=5)
        assert sorted((backend.replica, backend.url) for backend in router.backends) == [
            ("colocated-0", "http://a"), ("colocated-1", "http://b")]
        assert [backend.url for backend in router.pools["tiny"].servers] == ["http://a", "http://b"]
        assert source.acknowledged[-1][0] == 1
        # colocated-0 leaves with a request still on it: no new requests go to it, and the load
        # report keeps it until its last leg ends
        leaving = router.backends[0]
        leaving.in_flight = 1
        source.membership = Membership(2, (Member("colocated-1", "colocated", "http://b"),
                                           Member("colocated-2", "colocated", "http://c")))
        await router.watcher.sync()  # http://c does not answer yet: not admitted
        assert [backend.url for backend in router.pools["tiny"].servers] == ["http://b"]
        version, report = source.acknowledged[-1]
        assert version == 2 and report.in_flight == {"colocated-0": 1, "colocated-1": 0}
        leaving.in_flight = 0
        servers.up.add("http://c")
        router.record_first_event("colocated", 0.25)
        router.record_first_event("colocated", 0.75)
        await router.watcher.sync()
        assert source.acknowledged[-1][1].first_event_seconds == {"colocated": 0.5}
        assert [backend.replica for backend in router.pools["tiny"].servers] == ["colocated-1", "colocated-2"]
        assert source.acknowledged[-1][1].in_flight == {"colocated-1": 0, "colocated-2": 0}
        text = "\n".join(str(sample) for family in router.registry.collect() for sample in family.samples
                         if family.name == "tandem:router_backend_healthy")
        assert "'replica': 'colocated-2'" in text
        # everyone leaves: requests get 503 until servers come back, the model's name stays known
        source.membership = Membership(3)
        await router.watcher.sync()
        assert list(router.pools) == ["tiny"] and not router.pools["tiny"].servers
        await router.close()

    asyncio.run(scenario())


# -- the deploy command's flags ------------------------------------------------------------------------
def deploy_arguments(*flags: str):
    return build_parser().parse_args(["deploy", "--model", "m", *flags])


def test_serve_flags_reach_replicas_as_serve_reads_them():
    flags = ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager", "--cuda-graph-sizes", "1", "2",
             "--served-model-name", "a", "b", "--pd-progress-thread", "--max-itl-ms", "20"]
    arguments = deploy_arguments("--prefill-replicas", "1", "--decode-replicas", "1", *flags)
    passed = serve_arguments(arguments, arguments.serve_flag_actions)
    served = build_parser().parse_args(["serve", *passed])
    for name in ("max_num_seqs", "enable_prefix_caching", "enforce_eager", "cuda_graph_sizes", "served_model_name",
                 "pd_progress_thread", "max_itl_ms"):
        assert getattr(served, name) == getattr(arguments, name), name
    assert serve_arguments(deploy_arguments("--replicas", "1"), arguments.serve_flag_actions) == []
    with pytest.raises(SystemExit):  # set by the deployment itself
        deploy_arguments("--replicas", "1", "--pd-secret-file", "x")


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "1", "--prefill-replicas", "1"], "cannot be combined"),
    ([], "are required"),
    (["--prefill-replicas", "1"], "go together"),
    (["--replicas", "2", "--max-replicas", "3"], "need --autoscale"),
    (["--replicas", "4", "--autoscale", "--max-replicas", "3"], "must lie within"),
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "--min-prefill-replicas (or --prefill-replicas)"),
])
def test_deploy_refuses_sizes_that_make_no_sense(flags, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        role_sizes(deploy_arguments(*flags))


def test_deploy_sizes_per_role():
    sizes = role_sizes(deploy_arguments("--prefill-replicas", "1", "--decode-replicas", "2", "--autoscale",
                                        "--max-prefill-replicas", "3"))
    assert [(size.role, size.replicas, size.minimum, size.maximum) for size in sizes] == [
        ("prefill", 1, 1, 3), ("decode", 2, 2, 2)]
