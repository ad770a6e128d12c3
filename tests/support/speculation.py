"""Shared pieces of the speculative-decoding tests (no tests here)."""
from __future__ import annotations


def record_proposals(engine) -> dict:
    """(prompt, known tokens) -> the drafts proposed there, for every proposal ``engine`` makes
    from now on."""
    proposer = engine.speculator.proposer
    original, seen = proposer.run, {}

    def run(works):
        original(works)
        for work in works:
            sequence = work.sequence
            if sequence.draft_token_ids:
                seen[tuple(sequence.prompt_token_ids), sequence.num_tokens] = tuple(sequence.draft_token_ids)

    proposer.run = run
    return seen


def differing_proposals(proposals: dict, expected: dict) -> list:
    """Where two runs proposed different drafts at the same point."""
    return [(key[1], proposals[key], expected[key]) for key in set(proposals) & set(expected)
            if proposals[key] != expected[key]]
