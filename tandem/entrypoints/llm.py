"""The offline API, shaped like vLLM's: ``LLM(model=DIR).generate(prompts, params)``.

Runs the engine core in this process with the same output processor the server uses.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from tandem.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.protocol import EngineRequest
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]


class LLM:
    def __init__(self, model: Optional[str] = None, tokenizer: Optional[str] = None, **engine_options) -> None:
        """``model``: a Hugging Face model directory; none (or ``"demo"``): the built-in tiny
        demo model, as ``tandem serve`` uses without ``--model``."""
        from tandem.entrypoints.model_choice import resolve_model
        from tandem.frontend.tokenizer import load_tokenizer

        model, _ = resolve_model(model, flag="model")
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(tokenizer or model)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # -- generate --------------------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings, token-id lists, or ``{"prompt_token_ids": ...}``).

        Returns one ``RequestOutput`` per prompt, in the order given."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        return self._run([self._tokenize(p) for p in prompt_list], params_list, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict] = None):
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]
        return prompts

    @staticmethod
    def _as_params_list(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
        return params

    def _tokenize(self, prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer(prompt["prompt"])["input_ids"]
        return None, [int(t) for t in prompt]

    def _run(self, prompts: list[tuple[Optional[str], list[int]]], params_list: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        from tandem.frontend.output_processor import OutputProcessor

        processor = OutputProcessor(self.tokenizer, incremental_text=False)
        request_ids = []
        try:
            for (text, ids), params in zip(prompts, params_list):
                request_id = str(next(self._request_counter))
                self.engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=ids,
                                                      sampling_params=params))
                processor.add_request(request_id, text, ids, params)
                request_ids.append(request_id)
            return self._drain(processor, request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_requests(request_ids)
            raise

    def _drain(self, processor, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generate", unit="req",
                        disable=not use_tqdm or len(request_ids) < 2)
        with progress:
            while len(finished) < len(request_ids):
                outputs, stopped = processor.process(self.engine.step(), finished_only=True)
                for request_id, error in self.engine.take_rejections():
                    raise ValueError(error)  # (a grammar that failed to compile or timed out)
                if stopped:
                    self.engine.finish_sequences(stopped)
                for output in outputs:
                    if output.finished and output.request_id not in finished:
                        finished[output.request_id] = output
                        progress.update(1)
                if not self.engine.has_unfinished_requests() and len(finished) < len(request_ids):
                    raise RuntimeError("engine went idle with unfinished requests")
        self.engine.finish_in_flight()  # rows of finished sequences only: their pages go
        return [finished[request_id] for request_id in request_ids]
