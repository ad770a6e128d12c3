"""``tandem deploy`` on a two-node local Ray cluster (two raylets, ``ray.cluster_utils.Cluster``)
with the tiny llama, sanitizer on in every replica. One deployment serves the whole module, as an
operator would run it (an API key; the PD secret made by the deployment):

- 1P1D, then 2P1D (the autoscaler grows prefill under load): completions and chats through its
  router equal ``transformers`` (tokens and logprobs); the replicas land on both nodes;
- prefill replicas scaled 1 -> 2 -> 1 while requests keep coming: every request completes,
  exactly; the router's /metrics labels each replica;
- the PD secret reaches every replica through Ray, in their environment, never on a command line;
- a decode replica's actor killed mid-stream: the client gets an error event and its stream ends;
  a replacement starts and serves, exactly; the prefill replica's books balance;
- SIGTERM: the driver exits 0 and every process the deployment started is gone.
"""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import concurrent.futures  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from tests.support.oracle import LOGPROB_TOLERANCE  # noqa: E402
from tests.support.pd import wait_for  # noqa: E402
from tests.support.servers import REPOSITORY_ROOT, free_port, process_alive  # noqa: E402

pytest.importorskip("ray")

API_KEY = "deploy-test-key"
AUTHORIZATION = {"Authorization": f"Bearer {API_KEY}"}
NAME = "test"
ENGINE_FLAGS = ["--page-size", "4", "--max-total-tokens", "2048", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "8", "--pd-heartbeat-interval", "0.25", "--pd-peer-timeout", "3",
                "--pd-drain-timeout", "2", "--pd-transfer-timeout", "30", "--pd-bootstrap-timeout", "30"]
# Prefill grows while it has more than one leg in flight per replica (for 0.5 s), and shrinks
# after 4 s with fewer than 0.75: one request at a time on two replicas is idle enough.
AUTOSCALE_FLAGS = ["--autoscale", "--min-prefill-replicas", "1", "--max-prefill-replicas", "2",
                   "--scale-out-in-flight", "1", "--scale-out-after", "0.5", "--scale-in-in-flight", "0.75",
                   "--scale-in-after", "4"]
STARTUP_SECONDS = 240


@pytest.fixture(scope="module")
def ray_cluster():
    """Two raylets of two CPUs each: three replicas cannot share one node."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, namespace="tandem", log_to_driver=False)  # to read the registry
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class Deployment:
    """``tandem deploy`` as a child process (the driver, its router and supervisor)."""

    def __init__(self, ray_address: str, model_dir: str, log_path, arguments: list[str], name: str = NAME):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.environment = {**os.environ, "RAY_ADDRESS": ray_address, "TANDEM_SANITIZE": "1",
                            "PYTHONPATH": str(REPOSITORY_ROOT)}
        self.command = [sys.executable, "-m", "tandem.entrypoints.cli", "deploy", "--name", name, "--model",
                        model_dir, "--port", str(self.port), "--api-key", API_KEY, "--health-interval", "0.5",
                        "--log-level", "warning", *arguments]
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        self.process = subprocess.Popen(self.command, env=self.environment, stdout=self.log_file,
                                        stderr=subprocess.STDOUT, cwd=REPOSITORY_ROOT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert self.process.poll() is None, f"tandem deploy exited:\n{self.log()}"
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the deployment never served:\n{self.log()}"
            time.sleep(0.5)

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text()[-6000:]

    def status_command(self, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "deploy", "status", "--name", NAME,
                               *flags], env=self.environment, capture_output=True, text=True, timeout=120,
                              cwd=REPOSITORY_ROOT)

    def records(self) -> list[dict]:
        """The registry's records, read here (``tandem deploy status`` reads the same)."""
        import ray

        return ray.get(ray.get_actor(f"tandem-deploy-{NAME}").replicas.remote(), timeout=30)

    def serving(self, role: str) -> dict[str, str]:
        """Replica name -> URL of the ``role`` replicas the router routes to now (its /metrics)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        pattern = re.compile(r'tandem:router_backend_healthy\{replica="([^"]+)",role="' + role + r'",url="([^"]+)"\} 1')
        return {match.group(1): match.group(2) for match in pattern.finditer(text)}

    def dispatched(self, replica: str) -> float:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        match = re.search(r'tandem:router_backend_dispatched\{replica="' + replica + r'",[^}]*\} (\S+)', text)
        return float(match.group(1)) if match else 0.0

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log_file.close()


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def deployment(ray_cluster, model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("deploy_logs")
    deployment = Deployment(ray_cluster.address, model_dir, logs / "deploy.log",
                            ["--prefill-replicas", "1", "--decode-replicas", "1", *AUTOSCALE_FLAGS, *ENGINE_FLAGS])
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        deployment.kill()


# -- requests and the oracle ------------------------------------------------------------------------
def prompt_ids(seed: int, length: int) -> list[int]:
    return [(seed * 37 + position * 11) % 500 + 3 for position in range(length)]


def complete(deployment, prompt: list[int], max_tokens: int, timeout: float = 120) -> dict:
    response = httpx.post(deployment.base_url + "/v1/completions", headers=AUTHORIZATION, timeout=timeout, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 2,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_equals_oracle(choice: dict, oracle, prompt: list[int], max_tokens: int) -> None:
    reference = oracle.greedy(prompt, max_tokens)
    assert choice["token_ids"] == reference.token_ids
    for position, (token_id, logprob) in enumerate(zip(choice["token_ids"], choice["logprobs"]["token_logprobs"])):
        assert abs(logprob - reference.logprobs[position][token_id].item()) <= LOGPROB_TOLERANCE, position


def stream(deployment, prompt: list[int], max_tokens: int, on_event=None) -> tuple[int, list[dict]]:
    """A streamed completion: its status and its events (``on_event`` sees each as it comes)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    events = []
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, headers=AUTHORIZATION,
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if on_event is not None:
                    on_event(events)
    return response.status_code, events


def streamed_tokens(events: list[dict]) -> list[int]:
    return [token for event in events for choice in event.get("choices", []) for token in choice.get("token_ids") or []]


# -- the tests ----------------------------------------------------------------------------------------
def test_1p1d_completions_and_chat_equal_the_oracle(deployment, oracles, model_dir):
    oracle = oracles["llama"]
    for seed in range(2):
        prompt = prompt_ids(seed, 12)
        assert_equals_oracle(complete(deployment, prompt, 8), oracle, prompt, 8)
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    response = httpx.post(deployment.base_url + "/v1/chat/completions", headers=AUTHORIZATION, timeout=120, json={
        "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    expected_prompt = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False)
    assert answer["prompt_token_ids"] == list(expected_prompt)
    assert answer["choices"][0]["token_ids"] == oracle.greedy(list(expected_prompt), 8).token_ids

    answer = deployment.status_command("--json")
    assert answer.returncode == 0, answer.stderr[-3000:]
    replicas = json.loads(answer.stdout)["replicas"]
    assert {(record["role"], record["state"]) for record in replicas} == {("prefill", "serving"),
                                                                         ("decode", "serving")}
    assert all(record["healthy"] and record["url"].startswith("http://") for record in replicas)
    table = deployment.status_command().stdout.splitlines()
    assert table[1].split() == ["name", "role", "state", "health", "node", "gpus", "url"]
    assert sorted(line.split()[:4] for line in table[2:]) == [["decode-0", "decode", "serving", "healthy"],
                                                              ["prefill-0", "prefill", "serving", "healthy"]]
    assert set(deployment.serving("prefill")) == {"prefill-0"} and set(deployment.serving("decode")) == {"decode-0"}


def server_pids(deployment) -> list[int]:
    return [record["pid"] for record in deployment.records() if record.get("pid")]


def test_the_secret_reaches_replicas_through_ray_never_a_command_line(deployment):
    secrets = set()
    for pid in server_pids(deployment):
        environment = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        values = [item.split(b"=", 1)[1] for item in environment if item.startswith(b"TANDEM_PD_SECRET=")]
        assert len(values) == 1 and len(values[0]) >= 32, pid
        secrets.add(values[0])
    assert len(secrets) == 1  # one secret per deployment, the same on every replica
    secret = secrets.pop()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                command_line = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            assert secret not in command_line, entry
    for pid in server_pids(deployment):  # the API key reaches the servers by their environment too
        command_line = open(f"/proc/{pid}/cmdline", "rb").read()
        assert API_KEY.encode() not in command_line and b"--pd-secret-file" not in command_line


def test_prefill_scales_out_and_in_under_load_losing_nothing(deployment, oracles):
    """A steady client throughout; a burst grows prefill to two replicas (on both nodes, 2P1D);
    once the burst ends it shrinks back to one, drained. Every request completes, exactly."""
    oracle = oracles["llama"]
    done = threading.Event()
    results: list[tuple[list[int], dict]] = []

    def steady():
        seed = 100
        while not done.is_set():
            prompt = prompt_ids(seed, 10)
            results.append((prompt, complete(deployment, prompt, 4)))
            seed += 1
            time.sleep(0.2)  # a steady trickle, leaving the CPUs to the replica starting

    pool = concurrent.futures.ThreadPoolExecutor(12)
    steady_client = pool.submit(steady)
    deadline = time.monotonic() + STARTUP_SECONDS
    while len(deployment.records()) < 3:  # bursts of long prompts until a second prefill replica is placed
        assert time.monotonic() < deadline, f"prefill never scaled out:\n{deployment.log()}"
        burst = [pool.submit(complete, deployment, prompt_ids(200 + index, 120), 2) for index in range(6)]
        for index, future in enumerate(burst):
            results.append((prompt_ids(200 + index, 120), future.result()))
    wait_for(lambda: len(deployment.serving("prefill")) == 2, STARTUP_SECONDS,
             f"the second prefill replica never served:\n{deployment.log()}")
    # 2P1D, the replicas on both nodes: requests reach the newcomer (least loaded), exactly.
    nodes = {record["node_id"] for record in deployment.records() if record["state"] == "serving"}
    assert len(nodes) == 2
    newcomer, = set(deployment.serving("prefill")) - {"prefill-0"}
    before = deployment.dispatched(newcomer)
    # Probes three at a time: the newcomer's first request may still be running (a cold replica on
    # a busy machine), and while one probe holds the other replica the next goes to the newcomer.
    for first_seed in (300, 310, 320):
        probes = {seed: pool.submit(complete, deployment, prompt_ids(seed, 12), 6)
                  for seed in range(first_seed, first_seed + 3)}
        for seed, future in probes.items():
            assert_equals_oracle(future.result(), oracle, prompt_ids(seed, 12), 6)
        if deployment.dispatched(newcomer) > before:
            break
    assert deployment.dispatched(newcomer) > before
    # The burst is over: prefill shrinks back to one replica while the steady client goes on.
    wait_for(lambda: len(deployment.serving("prefill")) == 1, 60, f"prefill never scaled in:\n{deployment.log()}")
    wait_for(lambda: [record["role"] for record in deployment.records()].count("prefill") == 1, 60,
             "the drained prefill replica was never removed")
    time.sleep(1.0)
    done.set()
    steady_client.result(timeout=120)
    pool.shutdown()
    assert len(results) > 10
    for prompt, choice in results:
        assert choice["token_ids"] == oracle.greedy(prompt, len(choice["token_ids"])).token_ids
        assert choice["finish_reason"] == "length"


def reset_and_count_pages(url: str) -> int:
    httpx.post(url + "/reset_prefix_cache", headers=AUTHORIZATION, timeout=10)
    time.sleep(0.1)
    text = httpx.get(url + "/metrics", timeout=10).text
    return int(float(re.search(r"^tandem:kv_pages_used (\S+)", text, re.M).group(1)))


def assert_books_balance(url: str) -> None:
    wait_for(lambda: reset_and_count_pages(url) == 0, 15, f"{url} still holds pages")
    text = httpx.get(url + "/metrics", timeout=10).text
    queues = re.findall(r'^tandem:pd_queue_length\{[^}]*\} (\S+)', text, re.M)
    assert queues and all(float(value) == 0 for value in queues), queues


def test_a_killed_decode_actor_fails_its_stream_cleanly_and_is_replaced(deployment, oracles):
    oracle = oracles["llama"]
    (victim_name, victim_url), = deployment.serving("decode").items()
    records = {record["name"]: record for record in deployment.records()}
    server_pid = records[victim_name]["pid"]
    actor_pid = int(open(f"/proc/{server_pid}/stat").read().split(") ")[1].split()[1])  # the server's parent
    killed = threading.Event()

    def kill_after_a_few_tokens(events):
        if len(streamed_tokens(events)) >= 3 and not killed.is_set():
            killed.set()
            os.kill(actor_pid, signal.SIGKILL)

    started = time.monotonic()
    status, events = stream(deployment, prompt_ids(400, 12), 400, on_event=kill_after_a_few_tokens)
    assert killed.is_set() and time.monotonic() - started < 60
    assert status == 200 and "error" in events[-1], events[-3:]  # an error event ends the stream
    wait_for(lambda: not process_alive(server_pid), 15, "the server outlived its actor")
    # A replacement starts, joins the router and serves, exactly.
    wait_for(lambda: set(deployment.serving("decode")) - {victim_name}, STARTUP_SECONDS,
             f"no replacement decode replica:\n{deployment.log()}")
    replacement, = deployment.serving("decode")
    prompt = prompt_ids(401, 12)
    assert_equals_oracle(complete(deployment, prompt, 6), oracle, prompt, 6)
    assert deployment.dispatched(replacement) >= 1
    # The surviving prefill replica's books balance.
    for url in deployment.serving("prefill").values():
        assert_books_balance(url)
    assert_books_balance(deployment.serving("decode")[replacement])


def test_sigterm_removes_everything(deployment):
    servers = server_pids(deployment)
    actors = [int(open(f"/proc/{pid}/stat").read().split(") ")[1].split()[1]) for pid in servers]
    engines = [int(child) for pid in servers
               for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    assert servers and engines
    deployment.process.send_signal(signal.SIGTERM)
    assert deployment.process.wait(120) == 0, deployment.log()
    wait_for(lambda: not any(process_alive(pid) for pid in [*servers, *actors, *engines]), 30,
             "processes of the deployment outlived it")
    answer = deployment.status_command()
    assert answer.returncode == 2 and "no deployment named" in answer.stderr


def test_a_replica_that_cannot_start_ends_the_deployment_with_its_error(ray_cluster, model_dir, tmp_path):
    """The first replica of a role fails (a serve flag its engine refuses): the driver exits 2,
    naming the replica and quoting its server's error, and leaves nothing behind."""
    import ray

    broken = Deployment(ray_cluster.address, model_dir, tmp_path / "broken.log",
                        ["--replicas", "1", "--max-num-seqs", "0"], name="broken")
    try:
        assert broken.process.wait(STARTUP_SECONDS) == 2, broken.log()
        log = broken.log()
        assert "replica colocated-0 failed to start" in log and "max_num_seqs" in log, log
        with pytest.raises(ValueError):
            ray.get_actor("tandem-deploy-broken")
    finally:
        broken.kill()
