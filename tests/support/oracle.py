"""The oracle: ``transformers`` on the same weights (fp32, CPU), greedy tokens and top-k
logprobs, and the comparison every model-path test uses."""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROB_TOLERANCE = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated position: log_softmax over the vocabulary


class Oracle:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple, Reference] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                output_logits=True, return_dict_in_generate=True, eos_token_id=eos_token_id,
                pad_token_id=0, min_new_tokens=max_new_tokens if eos_token_id is None else 0,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
            self._cache[key] = Reference(tokens, logprobs)
        return self._cache[key]

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


def assert_matches(output, reference: Reference, top_k: int = 5, context: str = "") -> None:
    """Greedy tokens equal; each reported top-k logprob within 1e-4 of the oracle's; the reported
    top-k are the oracle's top-k (up to ties within the tolerance)."""
    tokens = list(output.token_ids)
    assert tokens == reference.token_ids[:len(tokens)] and len(tokens) == len(reference.token_ids), \
        f"{context}: tokens differ\n tandem: {tokens}\n oracle: {reference.token_ids}"
    assert output.logprobs is not None and len(output.logprobs) == len(tokens), f"{context}: no logprobs"
    for position, (entry, oracle_logprobs) in enumerate(zip(output.logprobs, reference.logprobs)):
        assert_position(entry, oracle_logprobs, top_k, f"{context} position {position}")


def assert_position(entry: dict, oracle_logprobs: torch.Tensor, top_k: int, context: str) -> None:
    assert len(entry) >= min(top_k, 1), f"{context}: empty logprobs"
    kth_best = oracle_logprobs.topk(top_k).values[-1].item()
    for token_id, logprob in entry.items():
        value = logprob.logprob if hasattr(logprob, "logprob") else logprob
        expected = oracle_logprobs[token_id].item()
        assert abs(value - expected) <= LOGPROB_TOLERANCE, \
            f"{context}: token {token_id} logprob {value} vs oracle {expected}"
    reported = sorted(entry.items(), key=lambda item: -item[1].logprob)
    top_reported = [token for token, lp in reported if lp.rank is not None and lp.rank <= top_k]
    assert len(top_reported) >= top_k, f"{context}: fewer than {top_k} ranked entries"
    for token in top_reported:
        assert oracle_logprobs[token].item() >= kth_best - LOGPROB_TOLERANCE, \
            f"{context}: token {token} is not in the oracle's top {top_k}"
