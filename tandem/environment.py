"""Every environment variable the ``tandem`` package reads, in one registry.

The modules that read a variable read it where they need it; this registry is what the docs'
reference page (``docs/environment.md``, written by ``scripts/docs_reference.py``) is made from,
and ``tests/unit/test_docs.py`` fails when a ``TANDEM_`` name in the package's source is missing
here (or a name here is read nowhere), so a new variable cannot go undocumented.
"""
from __future__ import annotations

from dataclasses import dataclass

SERVING = "serving"
TUNING = "tuning and measuring"
TESTS = "tests and benchmarks"
AUDIENCES = (SERVING, TUNING, TESTS)


@dataclass(frozen=True)
class EnvironmentVariable:
    name: str
    default: str  # what applies when it is unset
    meaning: str
    audience: str


VARIABLES = (
    EnvironmentVariable(
        "TANDEM_API_KEY", "none: the API is open",
        "the API key `tandem serve`, `tandem router` and `tandem deploy` require (`Authorization: Bearer KEY`) "
        "when `--api-key` is not given", SERVING),
    EnvironmentVariable(
        "TANDEM_PD_SECRET", "on loopback a secret generated for this user; else required",
        "the deployment secret that authenticates every PD control message, when `--pd-secret-file` is not "
        "given ([PD](pd.md)); kept out of Ray's records of a deployment", SERVING),
    EnvironmentVariable(
        "TANDEM_CACHE_DIR", "`~/.cache/tandem`",
        "where tandem keeps what it makes for this user: the demo model, the loopback PD secret", SERVING),
    EnvironmentVariable(
        "TANDEM_SANITIZE", "off",
        "`1`: sanitizer mode — freed pages poisoned, the books checked after every step, owner tags "
        "checked ([design](design.md)); on in every test", SERVING),
    EnvironmentVariable(
        "TANDEM_NIXL_UCX_ERROR_HANDLING", "`none` over loopback, NIXL's `peer` between hosts",
        "`none` or `peer`: UCX's error handling for the NIXL transfer agent (the same on every engine; "
        "[PD](pd.md))", SERVING),
    EnvironmentVariable(
        "TANDEM_NCCL_PEER_COPIES", "`1`",
        "`0`: the NCCL transfer backend sends through NCCL send/receive instead of CUDA IPC peer copies "
        "between GPUs of one host (set on the prefill server)", SERVING),
    EnvironmentVariable(
        "TANDEM_ALLREDUCE_ONE_SHOT_MAX_BYTES", "4 MiB for two ranks, 512 KiB for more",
        "tensor parallelism: the largest all-reduce taken one-shot over peer buffers "
        "([all-reduce](allreduce.md)); the same on every rank", TUNING),
    EnvironmentVariable(
        "TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES", "32 MiB for two ranks, 8 MiB for more",
        "tensor parallelism: the largest all-reduce taken two-shot; NCCL above it", TUNING),
    EnvironmentVariable(
        "TANDEM_ALLREDUCE_FUSED_MAX_BYTES", "2 MiB for two ranks, 512 KiB for more",
        "tensor parallelism: the largest all-reduce fused with the residual add and RMSNorm after it", TUNING),
    EnvironmentVariable(
        "TANDEM_FP8_FULL_ACCUMULATION", "off (fast accumulation)",
        "`1`: FP8 per-token products promote their sums to float32 every few steps of K instead of "
        "accumulating fast ([FP8 checkpoints](quantization.md))", TUNING),
    EnvironmentVariable(
        "TANDEM_DISABLE_PDL", "unset: early launch on Hopper",
        "set: no programmatic dependent launch (each kernel of a one- or two-token decode graph waits for "
        "the one before it to finish before it starts)", TUNING),
    EnvironmentVariable(
        "TANDEM_NCCL_DIRECT_BYTES", "64 MiB",
        "NCCL send/receive transfers: a page run this long is sent from the pages themselves", TUNING),
    EnvironmentVariable(
        "TANDEM_NCCL_STAGING_BYTES", "32 MiB",
        "NCCL send/receive transfers: shorter runs are packed into staged segments of at most this size",
        TUNING),
    EnvironmentVariable(
        "TANDEM_NCCL_MIN_CTAS", "NCCL's choice",
        "NCCL send/receive transfers: at least this many channels in a pair's communicator", TUNING),
    EnvironmentVariable(
        "TANDEM_NCCL_COALESCE", "`1`",
        "`0`: NCCL send/receive transfers post a write's operations one by one instead of coalesced", TUNING),
    EnvironmentVariable(
        "TANDEM_SIMULATE_ACCEPT_LEN", "unset",
        "benchmarks on random weights: speculative decoding accepts drafts as if their mean acceptance "
        "length were this (it changes outputs)", TESTS),
    EnvironmentVariable(
        "TANDEM_RANK_PROFILE", "unset",
        "a directory: tensor-parallel ranks 1..N-1 run their plan loop under cProfile and write it there "
        "(`rankN.prof`) when they stop (`benchmarks/offline.py --host-profile` sets it)", TESTS),
    EnvironmentVariable(
        "TANDEM_GRAPH_BUFFERS_ON_CPU", "unset",
        "`1` off a GPU: the CUDA-graph path's static buffers and copies run eagerly on a CPU (tests)", TESTS),
    EnvironmentVariable(
        "TANDEM_TEST_TRANSFER_FAILURE_PROB", "0",
        "tests: the probability that a transfer write fails (fault injection)", TESTS),
    EnvironmentVariable(
        "TANDEM_TEST_TRANSFER_FAILURE_SEED", "0",
        "tests: the seed of the injected transfer failures", TESTS),
    EnvironmentVariable(
        "TANDEM_TEST_STORE_WRITE_DELAY", "0",
        "tests: seconds each disk-tier write waits first, so a test can stop a server with writes in flight",
        TESTS),
)
