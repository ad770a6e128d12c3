"""The server's OpenAPI contract is true: schemathesis (every check) against a live ``tandem serve``.

One server (the built-in demo model, a real engine, an API key) on 127.0.0.1. Besides the
schemathesis run, the schema is read directly: every route documents its errors in OpenAI's
shape, never 422, and the request models state the bounds the server enforces; an undeclared
method is a 405 with ``Allow``.

The run uses ``--checks all`` and is bounded (``TANDEM_CONTRACT_EXAMPLES`` examples per operation
and phase, 60 by default; fixed seed ``TANDEM_CONTRACT_SEED``: both can be raised for a longer
hunt). ``tests/support/schemathesis_hooks.py`` makes the positive cases keep the rules between fields that
JSON Schema cannot state (the schema's descriptions state them), and adds a check that every
operation answered 2xx at least once.
"""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from types import SimpleNamespace  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("schemathesis")

from tandem.entrypoints.openai.app import create_app  # noqa: E402
from tandem.entrypoints.openai.serving import ServerState  # noqa: E402
from tests.support.servers import REPOSITORY_ROOT, ServerProcess  # noqa: E402

API_KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 64  # short generations keep the run near a minute on two cores
MAX_EXAMPLES = int(os.environ.get("TANDEM_CONTRACT_EXAMPLES", "60"))
SEED = int(os.environ.get("TANDEM_CONTRACT_SEED", "2"))
PUBLIC_ROUTES = {"/health", "/metrics", "/pd/info"}
MODEL_ROUTES = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
ERROR_REF = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    process = ServerProcess(["--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN), "--max-total-tokens", "8192",
                             "--log-level", "warning"], tmp_path_factory.mktemp("logs") / "server.log",
                            environment={"TANDEM_CACHE_DIR": str(cache)})
    process.start(timeout=300)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def schema(server):
    response = httpx.get(server.base_url + "/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


def operations(schema):
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def test_every_route_documents_its_errors(schema):
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert schema["components"]["securitySchemes"]["api_key"] == {"type": "http", "scheme": "bearer",
                                                                  "description": "the server's --api-key"}
    for path, method, operation in operations(schema):
        responses = operation["responses"]
        assert "422" not in responses, (method, path)
        expected = set()
        if "requestBody" in operation:
            expected.add("400")
        if path not in PUBLIC_ROUTES:
            expected.add("401")
            assert operation["security"] == [{"api_key": []}], path
        else:
            assert "security" not in operation, path
        if path in MODEL_ROUTES:
            expected.add("404")
        if path.startswith("/v1/") and method == "post":
            expected |= {"500", "503"}
            assert responses["503"]["headers"]["Retry-After"]["required"] is True
            assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert expected <= set(responses), (method, path, sorted(responses))
        for status in expected:
            assert responses[status]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}, (path, status)
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_request_models_state_the_servers_bounds(schema, server):
    models = schema["components"]["schemas"]
    completion = models["CompletionRequest"]["properties"]
    vocab_max = models["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"]
    for tokens, status in (([vocab_max], 200), ([vocab_max + 1], 400)):  # the bound is the vocabulary's
        assert httpx.post(server.base_url + "/detokenize", json={"tokens": tokens}, headers=AUTH,
                          timeout=30).status_code == status
    prompt_forms = completion["prompt"]["anyOf"]
    assert prompt_forms[0] == {"type": "string", "minLength": 1}
    assert all(form["minItems"] == 1 for form in prompt_forms[1:])
    assert prompt_forms[2]["items"] == {"type": "integer", "minimum": 0, "maximum": vocab_max}
    assert completion["n"]["minimum"] == 1 and completion["n"]["maximum"] == 128
    assert completion["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": MAX_MODEL_LEN - 1}
    assert completion["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert completion["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0}
    assert completion["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    assert completion["model"]["anyOf"][0] == {"type": "string", "enum": ["demo", ""]}
    assert completion["kv_transfer_params"]["type"] == "null"  # a colocated server
    tokenize = models["TokenizeRequest"]
    assert [sorted(variant["required"]) for variant in tokenize["oneOf"]] == [["prompt"], ["messages"]]
    chat = models["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["minItems"] == 1
    assert {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]} in chat["anyOf"]
    assert "max_model_len" in chat["description"] and "best_of" in models["CompletionRequest"]["description"]


def offline_schema(role: str, api_key=None) -> dict:
    """The schema of an app around a stand-in engine client (no server needed)."""
    endpoint = None if role == "colocated" else SimpleNamespace(role=role)
    client = SimpleNamespace(transfer_endpoint=endpoint, is_alive=True)
    state = ServerState(client=client, tokenizer=None, model_info=SimpleNamespace(vocab_size=100, max_model_len=50),
                        served_model_names=["a", "b"], model_path="/models/a", metrics=None, api_key=api_key)
    return create_app(state).openapi()


def test_schema_follows_the_servers_settings():
    keyless = offline_schema("colocated")
    assert "securitySchemes" not in keyless["components"]
    for path, method, operation in operations(keyless):
        assert "401" not in operation["responses"] and "security" not in operation, (method, path)
    request = keyless["components"]["schemas"]["ChatCompletionRequest"]
    assert request["properties"]["model"]["anyOf"][0]["enum"] == ["a", "b", ""]
    assert request["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 49
    decode = offline_schema("decode", api_key="k")["components"]["schemas"]
    assert decode["TransferParamsModel"]["properties"]["role"]["const"] == "decode"
    assert decode["CompletionRequest"]["properties"]["kv_transfer_params"]["anyOf"][0] == {
        "$ref": "#/components/schemas/TransferParamsModel"}
    assert decode["CompletionRequest"]["allOf"][0]["then"]["allOf"][0] == {"properties": {"n": {"const": 1}}}


@pytest.mark.parametrize("method, path, allowed", [
    ("TRACE", "/v1/models", "GET"), ("DELETE", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"),
    ("PATCH", "/health", "GET"), ("POST", "/metrics", "GET"), ("GET", "/tokenize", "POST"),
    ("DELETE", "/reset_prefix_cache", "POST"), ("TRACE", "/pd/info", "GET"),
])
def test_undeclared_methods_get_405_with_allow(server, method, path, allowed):
    response = httpx.request(method, server.base_url + path, headers=AUTH, timeout=30)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allowed
    error = response.json()["error"]
    assert error["code"] == 405 and error["type"] == "method_not_allowed_error" and error["param"] is None
    assert method in error["message"] and allowed in error["message"]


def test_the_schemas_edges_are_the_servers(server):
    """What JSON Schema allows, the server takes (an integer written 2.0, the safe-integer seed
    bound); what it forbids, the server answers 400 naming the field (once 500s among them)."""
    body = {"prompt": "hi", "max_tokens": 2.0, "seed": -(2 ** 53 - 1), "top_k": -1, "n": 2, "suffix": "",
            "ignore_eos": True}
    response = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    for field, value in [("seed", 2 ** 53), ("seed", 10 ** 30), ("top_k", 10 ** 30), ("stop_token_ids", [10 ** 30]),
                         ("max_tokens", MAX_MODEL_LEN), ("n", 129), ("temperature", "0.5"), ("max_tokens", True),
                         ("suffix", "x"), ("top_k", -2)]:
        response = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", field: value},
                              headers=AUTH, timeout=60)
        assert response.status_code == 400, (field, value, response.text)
        assert response.json()["error"]["param"] == field
    surrogate = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "a\\ud800"}',
                           headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt", surrogate.text


def test_schemathesis_finds_nothing(server, tmp_path):
    """Every schemathesis check, every phase that applies; zero failures and zero errors."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "schemathesis.cli", "run", server.base_url + "/openapi.json",
               "--checks", "all",
               "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "2",
               # every answer within a minute: a hang fails, a CPU shared with another test
               # worker (pytest -n 2) does not (the default limit is 10 s)
               "--max-response-time", "60",
               "--header", f"Authorization: Bearer {API_KEY}", "--request-timeout", "120",
               "--continue-on-failure", "--output-sanitize", "false", "--no-color",
               "--report", "json", "--report-json-path", str(report)]
    environment = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks",
                   "PYTHONPATH": str(REPOSITORY_ROOT), "TANDEM_CONTRACT_BASE_URL": server.base_url,
                   "TANDEM_CONTRACT_API_KEY": API_KEY}
    finished = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900)
    output = finished.stdout + finished.stderr
    assert report.exists(), output[-20000:]
    summary = json.loads(report.read_text())
    assert finished.returncode == 0 and summary["exit_code"] == 0, output[-20000:]
    assert summary["failures"] == [] and summary["errors"] == [], output[-20000:]
    assert summary["complete"] and summary["operations"]["tested"] == summary["operations"]["total"] == 9
    assert summary["phases"]["coverage"]["status"] == "success"
    assert summary["phases"]["fuzzing"]["status"] == "success"
    assert summary["test_cases"]["generated"] > 500
    assert server.process.poll() is None
    assert httpx.get(server.base_url + "/health", timeout=10).json() == {"status": "ok"}
