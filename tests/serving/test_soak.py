"""The soak with faults (``tests/support/soak.py``), short: mixed traffic (completions and chats,
streamed or not, n=2, stop strings, aborts, disconnects, bad requests) against one server, then
against 2P1D with 5% of transfer writes failing and a prefill server killed and restarted. Every
request ends exactly (as the offline reference run) or with a clean error, no valid request gets
a 5xx an injected fault does not explain, every survivor's pages are free at the end, RSS stays
flat, and the router takes the restarted server back."""
import os

os.environ["TANDEM_SANITIZE"] = "1"


import pytest


from tests.support import soak


@pytest.fixture(scope="module")
def prepared(model_dirs):
    arguments = soak.parse_arguments(["--model", model_dirs["llama"], "--concurrency", "4", "--sample-interval", "1"])
    model, references, templates = soak.prepare(arguments)
    return arguments, model, references, templates


def run(prepared, mode: str, duration: float):
    arguments, model, references, templates = prepared
    arguments.duration = duration
    result = soak.soak(mode, arguments, model, references, templates)
    assert not result.violations, [(r.outcome, r.template, r.action, r.detail) for r in result.violations[:5]]
    assert not result.problems, result.problems
    outcomes = {record.outcome for record in result.records}
    assert {"exact", "rejected", "disconnected"} <= outcomes, outcomes
    return result


def test_soak_one_server(prepared):
    run(prepared, "single", duration=6)


def test_soak_2p1d_with_transfer_failures_and_a_prefill_restart(prepared):
    result = run(prepared, "pd", duration=12)
    assert any(record.outcome == "fault_error" for record in result.records)
    assert result.restart is not None
