"""The engine core's surfaces: an executor at every TP size, one build for every rank, and the
public step context that speculation and PD see (nothing outside the engine calls a private
method of the engine core)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tandem
from tandem import LLM
from tandem.step_context import StepContext

PACKAGE = Path(tandem.__file__).parent


def test_one_rank_runs_an_in_process_executor_and_the_core_is_a_step_context(model_dirs):
    from tandem.engine.ranks.executor import InProcessExecutor

    llm = LLM(model=model_dirs["llama"], max_total_tokens=256, enforce_eager=True)
    try:
        engine = llm.engine
        assert isinstance(engine.executor, InProcessExecutor) and engine.executor.world_size == 1
        assert engine.executor.collective_rpc("pool_pages") == [[pool.num_pages for pool in engine.coordinator.pools]]
        assert engine.executor.agree_on_disk_reads([b"k"], 1) == 1
        members = [name for name in vars(StepContext) if not name.startswith("_")]
        members += list(StepContext.__annotations__)
        missing = [name for name in members if not hasattr(engine, name)]
        assert not missing, f"EngineCore lacks the StepContext members {missing}"
        for name, method in vars(StepContext).items():
            if callable(method) and not name.startswith("_"):
                declared = list(inspect.signature(method).parameters)
                assert list(inspect.signature(getattr(type(engine), name)).parameters) == declared, name
    finally:
        engine.shutdown()


def private_core_calls(source: str, where: str) -> list[str]:
    """``core._x`` / ``self.core._x`` / ``engine._x`` attribute reads in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name in ("core", "engine"):
                found.append(f"{where}:{node.lineno} {name}.{node.attr}")
    return found


def test_nothing_outside_the_engine_calls_the_engine_core_privately():
    assert private_core_calls("self.core._fork(s)\ncore._check_books()\ncore.fork(s)", "sample") == [
        "sample:1 core._fork", "sample:2 core._check_books"]
    calls = [call for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).parts[0] != "engine"
             for call in private_core_calls(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not calls, calls


@pytest.mark.parametrize("module", ["tandem.engine.core", "tandem.engine.ranks.worker"])
def test_every_rank_builds_through_build_rank(module):
    """Rank 0 and the worker ranks build model, state and runner in one place: neither builds a
    model, a coordinator or a runner by hand."""
    import importlib

    source = inspect.getsource(importlib.import_module(module))
    assert "build_rank(" in source
    for by_hand in ("build_model(", "build_coordinator(", "ModelRunner(", "register_state("):
        assert by_hand not in source, f"{module} builds {by_hand[:-1]} by hand"
