"""Speculative decoding for every family against ``transformers`` (fp32, CPU): greedy tokens and
top-5 logprobs equal with a draft identical to the target (every draft accepted: its state —
KV, MLA latents, indexer keys, recurrent slots — is right through chunked prefill, prefix hits
and preemption) and with a random draft (almost every draft rejected: rollback, recurrent
restores included, is exact). MTP drafts propose the same tokens under all of that as in a
plain run. Sampled outputs follow the target's distribution (chi-square)."""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.support.models import ARCH_OPTIONS
from tests.support.oracle import assert_matches
from tests.support.state_checks import HOST_TIER, check_movers_touch_registry
from tests.support.speculation import differing_proposals, record_proposals

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ALL_ARCHS = tuple(ARCH_OPTIONS)
MTP_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
EXACT_INDEXER = dict(indexer_cache_dtype="float32")  # DSA: comparable with transformers bit for bit
GREEDY = SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True, max_tokens=12)

_rng = random.Random(12)
_SHARED = [_rng.randrange(3, 500) for _ in range(40)]
# The first call computes the first three prompts (the shared prefix among them); the second
# call's prompt hits the prefix cache.
PROMPTS = ([[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 70)] + [_SHARED + [7, 8, 9]],
           [_SHARED + [_rng.randrange(3, 500) for _ in range(11)]])
# Pages of 8, a token budget of 24 (chunked prefill) and a pool of 120 tokens (preemption).
STRESS = dict(page_size=8, max_num_batched_tokens=24, max_total_tokens=120, max_num_seqs=8)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tokenizer_dir):
    """A tiny random llama sharing the test models' tokenizer: its guesses are almost never right."""
    from tandem.tools.make_model import make_model

    return str(make_model("llama", tmp_path_factory.mktemp("random_draft"), seed=5, hidden_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, intermediate_size=64, tokenizer_dir=tokenizer_dir))


def options_for(arch: str, **speculation) -> dict:
    return {**STRESS, **(EXACT_INDEXER if arch in ("deepseek_v32", "glm_moe_dsa") else {}), **speculation}


def run_workload(model_dir: str, record: bool = False, **options):
    """The workload's outputs, and what the draft proposed where (``record``)."""
    llm = LLM(model=model_dir, **options)
    proposals = record_proposals(llm.engine) if record else None
    outputs = []
    for prompts in PROMPTS:
        outputs += llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, outputs, proposals


def check_against_oracle(llm, outputs, oracle, context: str) -> None:
    prompts = [prompt for batch in PROMPTS for prompt in batch]
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], oracle.greedy(prompt, GREEDY.max_tokens), context=f"{context} {number}")
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and outputs[-1].num_cached_tokens > 0, context
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_identical_draft_is_exact_and_accepted(arch, model_dirs, oracles):
    llm, outputs, _ = run_workload(model_dirs[arch], **options_for(arch, speculative_model=model_dirs[arch],
                                                                num_speculative_tokens=3))
    check_against_oracle(llm, outputs, oracles[arch], f"{arch} identical draft")
    speculation = llm.engine.stats().speculation
    assert speculation.num_drafts > 10
    # A draft whose state were wrong anywhere (after a prefix hit, a preemption, a rollback)
    # would guess differently from the target it copies.
    assert speculation.num_accepted_tokens >= speculation.num_draft_tokens - 1, speculation


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_random_draft_is_exact(arch, model_dirs, oracles, random_draft):
    mtp = arch in MTP_ARCHS
    speculation = dict(speculative_method="mtp", num_speculative_tokens=2) if mtp else \
        dict(speculative_model=random_draft, num_speculative_tokens=3)
    llm, outputs, proposals = run_workload(model_dirs[arch], record=mtp, **options_for(arch, **speculation))
    check_against_oracle(llm, outputs, oracles[arch], f"{arch} random draft")
    stats = llm.engine.stats().speculation
    assert stats.num_drafts > 10 and stats.num_accepted_tokens <= 0.2 * stats.num_draft_tokens, stats
    if mtp:
        # The MTP layer's proposals equal those of a plain run (one chunk per prompt, no prefix
        # cache, no preemption): its state came through all of that intact.
        plain = {**options_for(arch, **speculation), "max_total_tokens": 2048, "max_num_batched_tokens": 512,
                 "enable_prefix_caching": False}
        reference, _, expected = run_workload(model_dirs[arch], record=True, **plain)
        assert reference.engine.stats().num_preemptions == 0
        common = set(proposals) & set(expected)
        assert len(common) >= 0.8 * len(expected), (len(common), len(expected))
        differing = differing_proposals(proposals, expected)
        assert not differing, differing[:5]


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probabilities`` (bins expecting fewer than 5 pooled)."""
    expected = probabilities * counts.sum()
    kept = expected >= 5
    observed = torch.cat([counts[kept], counts[~kept].sum()[None]])
    expected = torch.cat([expected[kept], expected[~kept].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    degrees = len(observed) - 1
    return torch.special.gammaincc(torch.tensor(degrees / 2.0, dtype=torch.float64), statistic.double() / 2).item()


@pytest.fixture(scope="module")
def noisy_draft(model_dirs, tmp_path_factory):
    """The llama test model with noise (a tenth of each matrix's spread) on its matrices: it
    agrees with the target often but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("noisy_draft")
    shutil.copytree(model_dirs["llama"], directory, dirs_exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    noisy = {name: tensor + 0.1 * tensor.std() * torch.randn(tensor.shape, generator=generator)
             if tensor.dim() > 1 else tensor for name, tensor in tensors.items()}
    save_file(noisy, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@torch.inference_mode()
def target_distributions(oracle, prompt: list[int], temperature: float):
    """The target's exact distribution of the second output token (over every first token), and
    of the third given that the first two are one of the likeliest pairs (each above 1e-4), with
    those pairs."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        return torch.softmax(oracle.model(prefixes).logits[:, -1].double() / temperature, dim=-1)

    first = next_probs(torch.tensor([prompt]))[0]
    vocabulary = torch.arange(len(first))
    prefixes = torch.cat([torch.tensor([prompt]).expand(len(first), -1), vocabulary[:, None]], dim=1)
    joint = first[:, None] * next_probs(prefixes)
    pairs = torch.nonzero(joint > 1e-4)
    weights = joint[pairs[:, 0], pairs[:, 1]]
    third = (weights[:, None] * next_probs(torch.cat([prefixes[pairs[:, 0]], pairs[:, 1:2]], dim=1))).sum(0)
    return joint.sum(0), third / weights.sum(), {tuple(pair) for pair in pairs.tolist()}


def test_sampled_outputs_follow_the_target_distribution(model_dirs, oracles, noisy_draft):
    """Rejection sampling keeps the target's distribution: over 1,500 sampled runs of one prompt
    with a draft that agrees with the target about half the time (so drafts are accepted and
    rejected alike), the second and third output tokens (both decided by a verification) have
    the frequencies the target's exact distributions predict (chi-square, p > 0.001)."""
    prompt, temperature, runs = [5, 17, 99, 230, 41, 8], 1.0, 1500
    llm = LLM(model=model_dirs["llama"], page_size=16, max_total_tokens=8192, max_num_seqs=256,
              speculative_model=noisy_draft, num_speculative_tokens=2, seed=3)
    outputs = llm.generate([prompt] * runs, SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    stats = llm.engine.stats().speculation
    assert stats.num_drafts >= runs and 0.2 < stats.acceptance_rate < 0.8, stats
    second, third, pairs = target_distributions(oracles["llama"], prompt, temperature)
    tokens = [output.outputs[0].token_ids for output in outputs]
    counts = torch.bincount(torch.tensor([t[1] for t in tokens]), minlength=len(second)).double()
    assert chi_square_p_value(counts, second) > 1e-3
    conditioned = torch.tensor([t[2] for t in tokens if (t[0], t[1]) in pairs])
    assert len(conditioned) > 0.8 * runs
    counts = torch.bincount(conditioned, minlength=len(third)).double()
    assert chi_square_p_value(counts, third) > 1e-3
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch,speculation", [("deepseek_v32", dict(speculative_method="mtp")),
                                              ("qwen3_next", dict(speculative_model="same", num_speculative_tokens=2))])
def test_movers_carry_the_draft_state(arch, speculation, model_dirs):
    """I1 with a draft: its buffers are registry buffers (beside the target's), every mover
    (the host tier's swap out and in, the sanitizer's poison) touches them, and one step wrote them."""
    if speculation.get("speculative_model") == "same":
        speculation = {**speculation, "speculative_model": model_dirs[arch]}
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512, enable_prefix_caching=False,
              **HOST_TIER, **speculation)
    engine = llm.engine
    draft_layers = set(engine.speculator.network.layer_names)
    assert draft_layers and draft_layers <= set(engine.registry.layer_names())
    assert {d.layer_name for d in engine.registry.buffers()} >= draft_layers
    check_movers_touch_registry(engine, require_nonzero=True)


def test_flags_and_their_errors():
    from tandem.config import EngineConfig
    from tandem.entrypoints.cli import build_parser, engine_config

    arguments = build_parser().parse_args(["serve", "--speculative-model", "/d", "--num-speculative-tokens", "4"])
    config = engine_config(arguments, "/m")
    assert (config.speculative_method, config.num_speculative_tokens, config.speculative_model) == ("draft", 4, "/d")
    for options, field in ((dict(speculative_method="eagle"), "speculative_method"),
                           (dict(speculative_method="draft", num_speculative_tokens=2), "speculative_model"),
                           (dict(speculative_method="mtp", speculative_model="/d"), "speculative_model"),
                           (dict(num_speculative_tokens=2), "num_speculative_tokens"),
                           (dict(speculative_method="mtp", num_speculative_tokens=0), "num_speculative_tokens"),
                           (dict(speculative_model="/d"), "num_speculative_tokens")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            EngineConfig(model="/m", **options)


def test_mtp_needs_next_n_layers_and_drafts_need_the_vocabulary(model_dirs, random_draft, tmp_path):
    import json
    import shutil

    with pytest.raises(ValueError, match="^speculative_method: 'mtp' needs a checkpoint with next-n"):
        LLM(model=model_dirs["llama"], max_total_tokens=256, speculative_method="mtp", num_speculative_tokens=1)
    shutil.copy(f"{random_draft}/config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    with pytest.raises(ValueError, match="^speculative_model: the draft has a vocabulary of 1024 tokens, the target 512"):
        LLM(model=model_dirs["llama"], max_total_tokens=256, load_format="dummy", speculative_model=str(tmp_path),
            num_speculative_tokens=1)


def test_simulated_acceptance_length_and_metrics(model_dirs, random_draft, monkeypatch):
    """TANDEM_SIMULATE_ACCEPT_LEN (benchmarks on random weights) accepts drafts at the asked mean
    length whatever they are; the counters reach the engine stats and the server's /metrics."""
    from tandem.entrypoints.openai.metrics import ServerMetrics

    monkeypatch.setenv("TANDEM_SIMULATE_ACCEPT_LEN", "2.5")
    llm = LLM(model=model_dirs["llama"], max_total_tokens=1024, speculative_model=random_draft,
              num_speculative_tokens=3)
    outputs = llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(output.outputs[0].token_ids) == 40 for output in outputs)
    stats = llm.engine.stats()
    assert stats.speculation.num_drafts > 0 and 2.4 <= stats.speculation.mean_acceptance_length <= 2.6
    text = ServerMetrics(lambda: stats).render().decode()
    for line in (f"tandem:spec_decode_num_drafts_total {float(stats.speculation.num_drafts)}",
                 f"tandem:spec_decode_num_accepted_tokens_total {float(stats.speculation.num_accepted_tokens)}",
                 f"tandem:spec_decode_num_draft_tokens_total {float(stats.speculation.num_draft_tokens)}",
                 "tandem:spec_decode_mean_acceptance_length "):
        assert line in text, line
    monkeypatch.setenv("TANDEM_SIMULATE_ACCEPT_LEN", "0.5")
    with pytest.raises(ValueError, match="^TANDEM_SIMULATE_ACCEPT_LEN: must be a number >= 1"):
        LLM(model=model_dirs["llama"], max_total_tokens=256, speculative_model=random_draft, num_speculative_tokens=1)


def test_sampling_options_and_seeds(model_dirs, random_draft):
    """Penalties, min_tokens bans, stop tokens, n > 1 and logprobs read each draft's position as
    a plain step would: greedy outputs equal speculation off. A seeded sampled request gives the
    same tokens alone and in a batch."""
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 30)]
    eos = LLM(model=model_dirs["llama"], max_total_tokens=1024).engine.model_info.eos_token_ids[0]
    greedy = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=10, stop_token_ids=[eos], logprobs=1, n=2)]
    outputs = {}
    for name, speculation in (("off", {}), ("on", dict(speculative_model=model_dirs["llama"], num_speculative_tokens=3))):
        llm = LLM(model=model_dirs["llama"], max_total_tokens=1024, **speculation)
        results = [llm.generate(prompts, params, use_tqdm=False) for params in greedy]
        outputs[name] = [[(c.token_ids, [sorted(p) for p in c.logprobs]) for o in r for c in o.outputs] for r in results]
        llm.engine.check_all_free()
    assert outputs["on"] == outputs["off"]
    llm = LLM(model=model_dirs["llama"], max_total_tokens=1024, speculative_model=random_draft, num_speculative_tokens=3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([prompts[1], prompts[0]], [SamplingParams(temperature=1.0, max_tokens=12), seeded],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batch
    llm.engine.check_all_free()


@torch.inference_mode()
def test_mtp_proposals_match_a_transformers_reference(model_dirs, oracles, tmp_path):
    """The MTP layer's first two proposals after a prompt equal a reference built from
    transformers' own DeepSeek-V3 decoder layer carrying the checkpoint's MTP weights: over the
    positions ``p`` of the prompt, ``eh_proj([enorm(embed(t[p + 1])), hnorm(h[p])])`` (``h``: the
    target's hidden state after its final norm) through the block, ``shared_head`` on top; then
    one chained step on the first proposal and the block's own normalised output."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["deepseek_v3"]
    config = json.loads(open(f"{model_dir}/config.json").read())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    with safe_open(f"{model_dir}/model-mtp.safetensors", framework="pt") as handle:
        mtp = {name[len(prefix):]: handle.get_tensor(name) for name in handle.keys()}
    renamed = {"model.norm.weight": mtp.pop("shared_head.norm.weight"), "lm_head.weight": mtp.pop("shared_head.head.weight"),
               "model.embed_tokens.weight": mtp.pop("embed_tokens.weight")}
    norms = {name: mtp.pop(f"{name}.weight") for name in ("enorm", "hnorm", "eh_proj")}
    renamed.update({f"model.layers.0.{name}": tensor for name, tensor in mtp.items()})
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                                                       "num_nextn_predict_layers": 0}))
    block = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    target = oracles["deepseek_v3"].model

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * weight

    def step(tokens, hidden):
        inputs = torch.cat([rms(block.model.embed_tokens(tokens), norms["enorm"]), rms(hidden, norms["hnorm"])], -1)
        output = block.model(inputs_embeds=(inputs @ norms["eh_proj"].T)[None],
                             position_ids=torch.arange(len(tokens))[None]).last_hidden_state[0]
        return block.lm_head(output[-1]).argmax().item(), output[-1]

    llm = LLM(model=model_dir, max_total_tokens=1024, speculative_method="mtp", num_speculative_tokens=2)
    proposals = record_proposals(llm.engine)
    rng = random.Random(23)
    for prompt in ([rng.randrange(3, 500) for _ in range(n)] for n in (6, 29, 50)):
        first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids[0]
        tokens = torch.tensor(prompt + [first])
        hidden = target.model(tokens[None, :-1]).last_hidden_state[0]
        one, carried = step(tokens[1:], hidden)
        two, _ = step(torch.cat([tokens[1:], torch.tensor([one])]), torch.cat([hidden, carried[None]]))
        assert proposals[tuple(prompt), len(prompt) + 1] == (one, two), prompt
    llm.engine.check_all_free()


def test_rollback_in_every_group():
    """The coordinator's speculation hooks fan out over the managers: a verification's copies are
    set aside only where a manager asks (a recurrent working slot) and only in the groups given;
    a rejection releases token pages holding only rejected tokens and restores a recurrent slot
    from its copy; a draft's chain runs on the copy; groups not given are left alone."""
    from tandem.kv.coordinator import StateCoordinator
    from tandem.kv.planner import allocate_buffers, plan_pools
    from tandem.kv.registry import StateRegistry
    from tandem.kv.spec import FullAttentionSpec, RecurrentSpec

    registry = StateRegistry()
    registry.register("attention", FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32))
    registry.register("recurrent", RecurrentSpec((4, 3), torch.float32, (2, 2), torch.float32))
    registry.register("draft.recurrent", RecurrentSpec((2, 3), torch.float32, (2, 2), torch.float32))
    registry.finalize()
    plan = plan_pools(registry, 4, max_total_tokens=64, memory_budget_bytes=None, max_num_seqs=2, speculative=True)
    assert plan.pages_of(1) == 2 * 2 + 1  # a working slot and a copy per sequence seat
    allocate_buffers(registry, plan, torch.device("cpu"))
    coordinator = StateCoordinator(registry, plan, enable_prefix_caching=False, sanitize=True)
    coordinator.speculation.reserve_for([0, 1, 2])  # a slot per recurrent group, reserved with the pages
    state = coordinator.new_state("s#0")
    assert coordinator.pages_needed(state, 10) == [3, 2, 2]
    coordinator.allocate(state, 10)
    assert [pool.num_usable - pool.num_free for pool in coordinator.pools] == [3, 2, 2]
    ssm, draft_ssm = registry.layer_buffers("recurrent")["ssm"], registry.layer_buffers("draft.recurrent")["ssm"]
    working, draft_working = state.page_tables[1][0], state.page_tables[2][0]
    ssm[working].fill_(1.0)
    owner = coordinator.speculation.set_aside(state, [0, 1])
    assert coordinator.speculation.set_aside(coordinator.new_state("s#1"), [0]) is None  # token pages need no copy
    chain = coordinator.speculation.chain_page_tables(state, owner)
    assert chain[0] is state.page_tables[0] and chain[1] != [working] and len(chain[1]) == 1
    ssm[working].fill_(2.0)  # what the verification wrote
    draft_ssm[draft_working].fill_(3.0)
    released = state.page_tables[0][2]
    assert coordinator.speculation.roll_back(state, owner, [0, 1], num_valid=10, num_written=10)
    assert not coordinator.speculation.roll_back(state, owner, [0, 1], num_valid=5, num_written=10)
    assert torch.all(ssm[working] == 1.0) and torch.all(draft_ssm[draft_working] == 3.0)
    assert len(state.page_tables[0]) == 2
    assert torch.isnan(registry.layer_buffers("attention")["key"][released]).all()  # poisoned
    coordinator.sanitizer.check_books(coordinator, [state])
    coordinator.speculation.end_set_aside(owner)
    assert coordinator.speculation.set_aside(state, [1]) == owner  # the slots serve the next set-aside
    coordinator.speculation.end_set_aside(owner)
    unreserved = coordinator.new_state("s#2")
    unreserved.page_tables[1].extend(coordinator.pools[1].allocate(1, unreserved.owner))
    with pytest.raises(RuntimeError, match="without slots reserved"):  # a step never allocates midway
        coordinator.speculation.set_aside(unreserved, [1])
    coordinator.free(unreserved)
    coordinator.free(state)
    coordinator.sanitizer.check_all_free(coordinator)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v32", "glm_moe_dsa", "qwen3_moe"])
def test_cuda_speculation_matches_oracle(arch, enforce_eager, model_dirs, oracles, monkeypatch):
    """On CUDA (Triton kernels; CUDA graphs for verification and the draft's passes unless
    ``enforce_eager``; bfloat16 only runs): greedy speculation equals the oracle (logprobs
    within 1e-3) with an identical draft (every draft accepted) and with MTP."""
    import tests.support.oracle as oracle_module
    from tandem.worker.cuda_graphs import CudaGraphRunner

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)
    replays = {"target": 0, "verify": 0, "draft": 0}
    replay = CudaGraphRunner.replay

    def counted_replay(self, step, *args, **kwargs):
        kind = "draft" if self is not self.runner.graphs else "verify" if len(step.chunks) < step.num_tokens \
            else "target"
        replays[kind] += 1
        return replay(self, step, *args, **kwargs)

    monkeypatch.setattr(CudaGraphRunner, "replay", counted_replay)
    speculation = dict(speculative_method="mtp", num_speculative_tokens=2) if arch in MTP_ARCHS else \
        dict(speculative_model=model_dirs[arch], num_speculative_tokens=3)
    llm, outputs, _ = run_workload(model_dirs[arch], **options_for(arch, device="cuda", dtype="float32",
                                                                   enforce_eager=enforce_eager, **speculation))
    check_against_oracle(llm, outputs, oracles[arch], f"{arch} cuda")
    if enforce_eager:
        assert not any(replays.values()), replays
    else:  # recurrent targets verify eagerly (a row's state would be read by the next row)
        assert replays["draft"] > 0 and (replays["verify"] > 0) == (arch != "qwen3_next"), replays
    stats = llm.engine.stats().speculation
    assert arch in MTP_ARCHS or stats.num_accepted_tokens >= stats.num_draft_tokens - 2, stats
    llm, outputs, _ = run_workload(model_dirs[arch], **options_for(arch, device="cuda", dtype="bfloat16",
                                                                   enforce_eager=enforce_eager, **speculation))
    assert all(len(output.outputs[0].token_ids) == GREEDY.max_tokens for output in outputs)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v32"])
def test_speculation_survives_swap_preemption(arch, model_dirs, oracles):
    """Preemption by swap (a host tier) moves the draft's state with the target's: outputs stay
    exact, an identical draft keeps being accepted, MTP proposals equal a plain run's."""
    mtp = arch in MTP_ARCHS
    speculation = dict(speculative_method="mtp", num_speculative_tokens=2) if mtp else \
        dict(speculative_model=model_dirs[arch], num_speculative_tokens=3)
    llm, outputs, proposals = run_workload(model_dirs[arch], record=mtp, host_cache_size=0.01,
                                           **options_for(arch, **speculation))
    swaps = llm.engine.stats().tiers.swaps
    assert swaps["out"] > 0 and swaps["in"] == swaps["out"], swaps
    check_against_oracle(llm, outputs, oracles[arch], f"{arch} swap")
    stats = llm.engine.stats().speculation
    if not mtp:
        assert stats.num_accepted_tokens >= stats.num_draft_tokens - 1, stats
        return
    plain = {**options_for(arch, **speculation), "max_total_tokens": 2048, "max_num_batched_tokens": 512,
             "enable_prefix_caching": False}
    _, _, expected = run_workload(model_dirs[arch], record=True, **plain)
    differing = differing_proposals(proposals, expected)
    assert not differing, differing[:5]
