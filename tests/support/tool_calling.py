"""Shared pieces of the tool-calling server tests (no tests here): chat templates that render
tools, calls and tool results in each parser's format, and an engine client stand-in that
"generates" a scripted text, so the server's parsing path can be driven end to end with outputs a
tiny random model would never write.

``ScriptedEngineClient`` has the ``EngineClient`` interface the routes use; it encodes the
scripted answer with the real tokenizer and feeds it one token per step through the real
``OutputProcessor`` (incremental detokenizer, stop handling), so markers that span several
tokens reach the parsers in pieces, as from a real engine.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

import httpx
import openai

from tandem.protocol import EngineStats, RequestDelta
from tandem.entrypoints.openai.app import create_app
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import ServerState
from tandem.entrypoints.openai.tool_choice import ToolCallingOptions
from tandem.frontend.engine_client import ModelInfo
from tandem.frontend.output_processor import OutputProcessor
from tandem.frontend.tokenizer import load_tokenizer

MODEL_NAME = "scripted"

# ChatML turns (the made tokenizer's special tokens) with each format's own way of writing tools,
# calls and results; the tool list is written as JSON in the system turn.
TOOLS_SYSTEM = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "{{ tool_instruction }}<|im_end|>\n{%- endif %}")

HERMES_TEMPLATE = TOOLS_SYSTEM.replace("{{ tool_instruction }}", "Call a function as <tool_call> "
                                       "a JSON object with name and arguments </tool_call>") + (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}")

LLAMA3_JSON_TEMPLATE = TOOLS_SYSTEM.replace("{{ tool_instruction }}", "Respond with a JSON object with name "
                                            "and parameters.") + (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>ipython\n{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}{\"name\": \"{{ call.function.name }}\", \"parameters\": "
    "{{ call.function.arguments | tojson }}}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}")

DEEPSEEK_V3_TEMPLATE = TOOLS_SYSTEM.replace("{{ tool_instruction }}", "Call functions in the tool-call format.") + (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ message.content }}"
    "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}<｜tool▁calls▁begin｜>{%- for call in message.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ call.function.name }}\n```json\n"
    "{{ call.function.arguments | tojson }}\n```<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>{%- endif %}"
    "<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}<think>{{ '\\n' }}{%- endif %}")

GLM45_TEMPLATE = TOOLS_SYSTEM.replace("{{ tool_instruction }}", "Call a function as <tool_call>name "
                                      "<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>.") + (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>observation\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>{{ call.function.name }}\n"
    "{%- for key, value in call.function.arguments.items() %}\n<arg_key>{{ key }}</arg_key>\n<arg_value>"
    "{{ value if value is string else value | tojson }}</arg_value>{%- endfor %}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- if enable_thinking is defined and not "
    "enable_thinking %}<think></think>{%- endif %}{%- endif %}")



def keep_newlines(template: str) -> str:
    """transformers renders templates with ``trim_blocks`` (a newline right after a block tag is
    dropped): write those newlines as expressions. Earlier thinking is shown before the content."""
    template = template.replace("{{ message.content }}", "{% if message.reasoning_content %}<think>"
                                "{{ message.reasoning_content }}</think>{% endif %}{{ message.content }}")
    return template.replace("%}\n", "%}{{ '\\n' }}")


TEMPLATES = {name: keep_newlines(template) for name, template in (
    ("hermes", HERMES_TEMPLATE), ("llama3_json", LLAMA3_JSON_TEMPLATE), ("deepseek_v3", DEEPSEEK_V3_TEMPLATE),
    ("glm45", GLM45_TEMPLATE))}


class ScriptedEngineClient:
    """Answers each request with the scripted text whose key occurs in its prompt (see the module
    docstring); records the prompts. ``finish`` is the finish reason of a script that runs to
    its end ("stop"); ``max_tokens`` still cuts it ("length")."""

    def __init__(self, tokenizer, scripts: dict[str, str], vocab_size: int):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.output_processor = OutputProcessor(tokenizer)
        self.model_info = ModelInfo(vocab_size, 4096, (0,))
        self.stats = EngineStats()
        self.prompts: list[str] = []
        self.transfer_endpoint = None
        self.dead_reason: Optional[str] = None
        self.num_in_flight = 0
        self.is_alive = True

    def script_for(self, prompt: str) -> str:
        matches = [key for key in self.scripts if key in prompt]
        assert len(matches) == 1, f"no single script for the prompt: {matches}"
        return self.scripts[matches[0]]

    async def generate(self, request_id, prompt, prompt_token_ids, params, arrival_time=None, transfer=None):
        self.prompts.append(prompt)
        token_ids = self.tokenizer.encode(self.script_for(prompt), add_special_tokens=False)
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        self.num_in_flight += 1
        try:
            for step, token_id in enumerate(token_ids[:params.max_tokens]):
                last = step + 1 == min(len(token_ids), params.max_tokens)
                finish = None if not last else ("stop" if step + 1 == len(token_ids) else "length")
                deltas = [RequestDelta(request_id=request_id, index=index, new_token_ids=[token_id],
                                       num_prompt_tokens=len(prompt_token_ids) if step == 0 else 0,
                                       finish_reason=finish) for index in range(params.n)]
                outputs, _ = self.output_processor.process(deltas)
                for output in outputs:
                    yield output
                await asyncio.sleep(0)
        finally:
            self.num_in_flight -= 1
            self.output_processor.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.output_processor.abort(request_id)

    def reset_prefix_cache(self) -> None:
        pass


def scripted_server(tokenizer_dir, template: str, scripts: dict[str, str], **tool_calling) -> ServerState:
    """A server state over a ``ScriptedEngineClient``, its tokenizer carrying ``template``."""
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.chat_template = template
    client = ScriptedEngineClient(tokenizer, scripts, vocab_size=512)
    return ServerState(client=client, tokenizer=tokenizer, model_info=client.model_info,
                       served_model_names=[MODEL_NAME], model_path=str(tokenizer_dir),
                       metrics=ServerMetrics(lambda: EngineStats()), tool_calling=ToolCallingOptions(**tool_calling))


def run_with_client(state: ServerState, work: Callable):
    """Run ``await work(openai_client, http_client)`` against the app, in-process."""
    async def main():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as http:
            sdk = openai.AsyncOpenAI(base_url="http://tandem/v1", api_key="unused", http_client=http, max_retries=0)
            return await work(sdk, http)

    return asyncio.run(main())


async def collect_stream(stream) -> dict:
    """Add up a streamed chat completion (SDK chunks): per choice, the text fields, each tool
    call's id, name and arguments, and the finish reason. Checks a call's name comes once."""
    choices: dict[int, dict] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            total = choices.setdefault(choice.index, {"content": "", "reasoning_content": "", "tool_calls": [],
                                                      "finish_reason": None})
            delta = choice.delta
            total["content"] += delta.content or ""
            total["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(total["tool_calls"]) and call.function.name
                    total["tool_calls"].append({"id": call.id, "name": call.function.name, "arguments": ""})
                else:
                    assert call.function.name is None, "a call's name is sent once"
                total["tool_calls"][call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                total["finish_reason"] = choice.finish_reason
    return choices


def message_summary(choice) -> dict:
    """The non-streamed choice in ``collect_stream``'s shape (ids left out of the comparison)."""
    message = choice.message
    return {"content": message.content or "", "reasoning_content": getattr(message, "reasoning_content", None) or "",
            "tool_calls": [{"name": call.function.name, "arguments": call.function.arguments}
                           for call in message.tool_calls or []],
            "finish_reason": choice.finish_reason}


def without_ids(summary: dict) -> dict:
    return {**summary, "tool_calls": [{key: value for key, value in call.items() if key != "id"}
                                      for call in summary["tool_calls"]]}
