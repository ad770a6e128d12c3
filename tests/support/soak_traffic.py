"""The soak's traffic: request templates, their reference outputs, one client request, and what
its ending counts as.

Valid templates are greedy (so each has one right answer, computed once by an offline ``LLM`` on
the same model: the reference run): completions and chat, streamed or not, n=2, stop strings,
logprobs, short and long (several prefill chunks) prompts. Each valid request is sent as is, or
aborted (a client timeout mid-request), or disconnected (a stream closed after two events). Bad
templates are malformed or out-of-range requests the server must refuse with a 4xx.

Outcomes (``Outcome``): ``exact`` (equal to the reference: every choice's text and token ids),
``rejected`` (a bad request refused with the expected status), ``aborted`` / ``disconnected``
(the client gave up), ``fault_error`` (a clean OpenAI-style error, 5xx or in-stream, caused by an
injected fault: its message names it). Violations: ``mismatch``, ``unexpected_status`` (a
valid request refused, or a bad one not refused), ``unexpected_5xx`` (a 5xx or error event not
explained by a fault), ``unclean_error`` (an error without an OpenAI error body), ``transport``
(the connection to the server under test failed), ``hung`` (no answer within the limit).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

CLEAN_OUTCOMES = ("exact", "rejected", "aborted", "disconnected", "fault_error")
VIOLATIONS = ("mismatch", "unexpected_status", "unexpected_5xx", "unclean_error", "transport", "hung")
WORDS = ("time story river light mountain garden window morning city music paper voice water stone king road "
         "winter summer friend letter forest market island bridge candle dream ocean silver"
         ).split()
REQUEST_TIMEOUT = 120.0


@dataclass(frozen=True)
class Template:
    name: str
    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict  # without "stream" and "model"
    expected_status: int = 200  # a bad template: the 4xx it must get
    raw: Optional[bytes] = None  # a bad template sent as these bytes instead of JSON


@dataclass(frozen=True)
class Reference:
    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]


@dataclass
class Record:
    template: str
    action: str  # "send", "stream", "abort", "disconnect", "bad"
    outcome: str
    started: float
    seconds: float
    first_token_seconds: Optional[float] = None
    detail: str = ""


def prompt_of(generator: random.Random, num_words: int) -> str:
    return " ".join(generator.choice(WORDS) for _ in range(num_words))


def valid_templates(seed: int) -> list[Template]:
    generator = random.Random(seed)
    greedy = {"temperature": 0, "return_token_ids": True}
    templates = []
    for index, (words, max_tokens) in enumerate([(4, 12), (12, 8), (40, 10), (120, 6), (8, 20), (60, 12)]):
        prompt = prompt_of(generator, words)
        templates.append(Template(f"completion-{index}", "/v1/completions",
                                  {"prompt": prompt, "max_tokens": max_tokens, **greedy}))
        messages = [{"role": "user", "content": prompt}]
        templates.append(Template(f"chat-{index}", "/v1/chat/completions",
                                  {"messages": messages, "max_tokens": max_tokens, **greedy}))
    templates.append(Template("completion-logprobs", "/v1/completions",
                              {"prompt": prompt_of(generator, 16), "max_tokens": 8, "logprobs": 2, **greedy}))
    templates.append(Template("completion-n2", "/v1/completions",
                              {"prompt": prompt_of(generator, 10), "max_tokens": 8, "n": 2, **greedy}))
    return templates


def stop_templates(templates: list[Template], references: dict[str, Reference]) -> list[Template]:
    """Stop-string variants of the first templates: each stops at a piece of its own reference
    text, so the stop is sure to be hit."""
    stopped = []
    for template in templates[:4]:
        text = references[template.name].texts[0]
        piece = text[len(text) // 2:len(text) // 2 + 3].strip()
        if piece:
            stopped.append(Template(f"{template.name}-stop", template.route, {**template.body, "stop": [piece]}))
    return stopped


def bad_templates(vocab_size: int, max_model_len: int) -> list[Template]:
    completion, chat = "/v1/completions", "/v1/chat/completions"
    return [
        Template("bad-temperature", completion, {"prompt": "hello", "temperature": -1}, 400),
        Template("bad-max-tokens", completion, {"prompt": "hello", "max_tokens": -5}, 400),
        Template("bad-n", completion, {"prompt": "hello", "n": 0}, 400),
        Template("bad-empty-prompt", completion, {"prompt": ""}, 400),
        Template("bad-token-id", completion, {"prompt": [vocab_size + 7], "max_tokens": 2}, 400),
        Template("bad-too-long", completion, {"prompt": "hello", "max_tokens": max_model_len + 10}, 400),
        Template("bad-logprobs", completion, {"prompt": "hello", "logprobs": 50}, 400),
        Template("bad-role", chat, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
        Template("bad-model", completion, {"prompt": "hello", "model": "no-such-model"}, 404),
        Template("bad-json", completion, {}, 400, raw=b'{"prompt": "unterminated'),
    ]


def compute_references(llm, templates: list[Template]) -> dict[str, Reference]:
    """Each valid template's output from the offline engine (one batch per route)."""
    from tandem.sampling_params import SamplingParams

    def params(body: dict) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], n=body.get("n", 1),
                              stop=body.get("stop"), logprobs=body.get("logprobs"))

    references = {}
    completions = [t for t in templates if t.route == "/v1/completions"]
    chats = [t for t in templates if t.route == "/v1/chat/completions"]
    outputs = llm.generate([t.body["prompt"] for t in completions], [params(t.body) for t in completions],
                           use_tqdm=False) if completions else []
    outputs += llm.chat([t.body["messages"] for t in chats], [params(t.body) for t in chats],
                        use_tqdm=False) if chats else []
    for template, output in zip(completions + chats, outputs):
        references[template.name] = Reference(tuple(choice.text for choice in output.outputs),
                                              tuple(tuple(choice.token_ids) for choice in output.outputs))
    return references


@dataclass
class Traffic:
    """What one soak sends: templates, references, the mix of actions, and how errors are judged."""
    base_url: str
    model: str
    headers: dict
    valid: list[Template]
    bad: list[Template]
    references: dict[str, Reference]
    unsupported: dict[str, str] = field(default_factory=dict)  # template -> a word its 400 must name
    # (message, request start, request end) -> whether an injected fault explains the error
    is_fault: Callable[[str, float, float], bool] = lambda message, start, end: False

    def choose(self, generator: random.Random) -> tuple[Template, str]:
        roll = generator.random()
        if roll < 0.10:
            return generator.choice(self.bad), "bad"
        template = generator.choice(self.valid)
        if roll < 0.17:
            return template, "abort"
        if roll < 0.24:
            return template, "disconnect"
        return template, "stream" if roll < 0.62 else "send"


async def run_request(client: httpx.AsyncClient, traffic: Traffic, template: Template, action: str,
                      generator: random.Random) -> Record:
    started = time.monotonic()
    record = Record(template.name, action, "", started, 0.0)
    body = {"model": traffic.model, **template.body}
    try:
        if action == "bad":
            await send_bad(client, traffic, template, body, record)
        elif action in ("stream", "disconnect"):
            await asyncio.wait_for(send_stream(client, traffic, template, body, record, action == "disconnect"),
                                   REQUEST_TIMEOUT)
        else:
            timeout = generator.uniform(0.02, 0.5) if action == "abort" else REQUEST_TIMEOUT
            try:
                response = await asyncio.wait_for(client.post(traffic.base_url + template.route, json=body,
                                                              headers=traffic.headers), timeout)
            except asyncio.TimeoutError:
                if action != "abort":
                    raise
                record.outcome = "aborted"
            else:
                judge_response(traffic, template, response, record)
    except asyncio.TimeoutError:
        record.outcome, record.detail = "hung", f"no answer within {REQUEST_TIMEOUT:g} s"
    except httpx.HTTPError as error:
        record.outcome, record.detail = "transport", f"{type(error).__name__}: {error}"
    record.seconds = time.monotonic() - started
    return record


async def send_bad(client, traffic: Traffic, template: Template, body: dict, record: Record) -> None:
    if template.raw is not None:
        response = await client.post(traffic.base_url + template.route, content=template.raw,
                                     headers={**traffic.headers, "Content-Type": "application/json"})
    else:
        response = await client.post(traffic.base_url + template.route, json=body, headers=traffic.headers)
    if response.status_code == template.expected_status and error_message(response.content) is not None:
        record.outcome = "rejected"
    else:
        record.outcome = "unexpected_status"
        record.detail = f"{response.status_code} (expected {template.expected_status}): {response.text[:200]}"


def judge_response(traffic: Traffic, template: Template, response: httpx.Response, record: Record) -> None:
    if response.status_code == 200:
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        texts = [choice.get("text", choice.get("message", {}).get("content")) or "" for choice in choices]
        judge_output(traffic, template, texts, [choice.get("token_ids") or [] for choice in choices], record)
        return
    judge_error(traffic, template, response.status_code, response.content, record)


def judge_error(traffic: Traffic, template: Template, status: int, content: bytes, record: Record) -> None:
    message = error_message(content)
    if message is None:
        record.outcome, record.detail = "unclean_error", f"{status}: {content[:200]!r}"
    elif template.name in traffic.unsupported and status == 400 and traffic.unsupported[template.name] in message:
        record.outcome = "rejected"
    elif status >= 500 and traffic.is_fault(message, record.started, time.monotonic()):
        record.outcome, record.detail = "fault_error", message[:200]
    elif status >= 500:
        record.outcome, record.detail = "unexpected_5xx", f"{status}: {message[:300]}"
    else:
        record.outcome, record.detail = "unexpected_status", f"{status}: {message[:300]}"


def judge_output(traffic: Traffic, template: Template, texts: list[str], token_ids: list[list[int]],
                 record: Record) -> None:
    if template.name in traffic.unsupported:
        record.outcome, record.detail = "unexpected_status", "200 for a request the server cannot serve"
        return
    reference = traffic.references[template.name]
    if tuple(texts) == reference.texts and tuple(tuple(ids) for ids in token_ids) == reference.token_ids:
        record.outcome = "exact"
    else:
        record.outcome = "mismatch"
        record.detail = f"got {texts!r} {token_ids}, expected {list(reference.texts)!r} {reference.token_ids}"


async def send_stream(client, traffic: Traffic, template: Template, body: dict, record: Record,
                      disconnect: bool) -> None:
    texts: dict[int, str] = {}
    token_ids: dict[int, list[int]] = {}
    events = 0
    async with client.stream("POST", traffic.base_url + template.route, json={**body, "stream": True},
                             headers=traffic.headers) as response:
        if response.status_code != 200:
            judge_error(traffic, template, response.status_code, await response.aread(), record)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:  # an error once the stream began: its body's code is its status
                code = event["error"].get("code") if isinstance(event["error"], dict) else None
                judge_error(traffic, template, code if isinstance(code, int) else 500, data.encode(), record)
                return
            events += 1
            for choice in event.get("choices", []):
                piece = choice.get("text", (choice.get("delta") or {}).get("content")) or ""
                if piece and record.first_token_seconds is None:
                    record.first_token_seconds = time.monotonic() - record.started
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
                token_ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
            if disconnect and events >= 2:
                record.outcome = "disconnected"
                return
    indices = sorted(set(texts) | set(token_ids))
    judge_output(traffic, template, [texts.get(i, "") for i in indices], [token_ids.get(i, []) for i in indices],
                 record)


def error_message(content: bytes) -> Optional[str]:
    """The message of an OpenAI-style error body, or None when the body is not one."""
    try:
        body = json.loads(content)
        message = body["error"]["message"]
        return message if isinstance(message, str) else None
    except (ValueError, KeyError, TypeError):
        return None
