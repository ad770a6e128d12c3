"""Tests for ``tandem make-model``: tiny random-weight checkpoints with a local tokenizer."""

import os

os.environ["TANDEM_SANITIZE"] = "1"

import argparse
import json
import statistics
import threading

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.tools import make_model as make_model_module
from tandem.tools.demo_model import ensure_demo_model
from tandem.tools.make_model import add_cli_parser, architecture_names, make_model
from tandem.tools.tokenizer_maker import (
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    train_tokenizer,
    training_corpus,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ARCHITECTURES = ("llama", "qwen2", "qwen3")
SAMPLE_TEXTS = (
    "Hello world! The pilot reads 12 books.",
    "def total(items):\n    return sum(items)  # 3.14",
    "  leading spaces, tabs\tand new\r\nlines; unicode wörld 🙂",
    "<|im_start|>user\nhi<|im_end|>",
)


@pytest.fixture(scope="module")
def tokenizer_source(tmp_path_factory):
    """A llama model directory whose trained tokenizer the other tests copy (vocab 512)."""
    return make_model("llama", tmp_path_factory.mktemp("tokenizer_source"))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_source):
    """One default-sized model directory per architecture."""
    return {
        arch: make_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir=tokenizer_source)
        for arch in ARCHITECTURES
    }


def load_model(path):
    """Load a checkpoint in float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def read_config(path):
    """Return the parsed config.json of a model directory."""
    return json.loads((path / "config.json").read_text())


@torch.no_grad()
def greedy_rollout(model, prompt_ids, steps):
    """Greedy-decode ``steps`` tokens; return (new token ids, top1 - top2 logit gap per step)."""
    new_tokens, gaps = [], []
    output = model(torch.tensor([prompt_ids]), use_cache=True)
    for _ in range(steps):
        logits = output.logits[0, -1]
        assert torch.isfinite(logits).all()
        top_two = torch.topk(logits, 2).values
        gaps.append(float(top_two[0] - top_two[1]))
        new_tokens.append(int(logits.argmax()))
        output = model(torch.tensor([new_tokens[-1:]]), past_key_values=output.past_key_values, use_cache=True)
    return new_tokens, gaps


def test_architecture_table_lists_the_supported_architectures():
    assert set(ARCHITECTURES) <= set(architecture_names())
    with pytest.raises(ValueError, match="unknown architecture"):
        make_model("no-such-arch", "unused")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_model_and_tokenizer_load_back(models, arch):
    path = models[arch]
    model = load_model(path)
    config = read_config(path)
    assert config["model_type"] == arch
    assert config["architectures"] == [type(model).__name__]
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) <= config["vocab_size"]
    output = model(torch.tensor([tokenizer("Hello world")["input_ids"]]))
    assert output.logits.shape[-1] == config["vocab_size"]


def test_qwen2_has_random_nonzero_qkv_bias(models):
    attention = load_model(models["qwen2"]).model.layers[0].self_attn
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert projection.bias is not None
        assert projection.bias.abs().min() > 0 and projection.bias.std() > 0.05


def test_qwen3_has_random_qk_norms(models):
    attention = load_model(models["qwen3"]).model.layers[0].self_attn
    for norm in (attention.q_norm, attention.k_norm):
        assert norm.weight.shape == (16,)
        assert norm.weight.std() > 0.05 and abs(norm.weight.mean() - 1) < 0.5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_special_token_ids_match_config(models, arch):
    path = models[arch]
    config = read_config(path)
    generation_config = json.loads((path / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == END_OF_TEXT_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["pad_token_id"] == tokenizer.pad_token_id
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    eos_ids = generation_config["eos_token_id"]
    assert tokenizer.eos_token_id in eos_ids
    assert tokenizer.convert_tokens_to_ids(IM_END_TOKEN) in eos_ids
    assert max(tokenizer.get_vocab().values()) < config["vocab_size"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_round_trips_and_matches_tokenizer_json(models, arch):
    path = models[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    raw_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in SAMPLE_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert ids == raw_tokenizer.encode(text).ids
    special_ids = tokenizer("<|im_start|>user<|im_end|>")["input_ids"]
    assert special_ids[0] == tokenizer.convert_tokens_to_ids(IM_START_TOKEN)
    assert special_ids[-1] == tokenizer.convert_tokens_to_ids(IM_END_TOKEN)


def test_tokenizer_compresses_training_like_text(models):
    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    text = " ".join(training_corpus(num_lines=20, seed=99))
    assert len(tokenizer(text)["input_ids"]) < 0.7 * len(text.encode())


def test_chat_template(models):
    tokenizer = AutoTokenizer.from_pretrained(models["qwen3"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for message in messages:
        assert f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == without_prompt + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START_TOKEN)) == len(messages) + 1


def test_tokenizer_training_is_deterministic(tokenizer_source, tmp_path):
    train_tokenizer(512).save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_source / "tokenizer.json").read_bytes()


def test_same_arguments_give_same_weights_and_seed_changes_them(models, tokenizer_source, tmp_path):
    again = make_model("qwen3", tmp_path / "again", tokenizer_dir=tokenizer_source)
    reseeded = make_model("qwen3", tmp_path / "reseeded", seed=1, tokenizer_dir=tokenizer_source)
    reference = load_model(models["qwen3"]).state_dict()
    assert all(torch.equal(reference[name], value) for name, value in load_model(again).state_dict().items())
    reseeded_embedding = load_model(reseeded).model.embed_tokens.weight
    assert not torch.equal(reference["model.embed_tokens.weight"], reseeded_embedding)


@pytest.mark.parametrize("tied", [False, True])
def test_tie_word_embeddings_is_honoured(tokenizer_source, tmp_path, tied):
    path = make_model("llama", tmp_path, tie_word_embeddings=tied, tokenizer_dir=tokenizer_source)
    assert read_config(path)["tie_word_embeddings"] is tied
    with safe_open(path / "model.safetensors", framework="pt") as weights:
        assert ("lm_head.weight" in weights.keys()) is not tied
    model = load_model(path)
    same_storage = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert same_storage is tied
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_sharded_checkpoint_loads_back(models, tokenizer_source, tmp_path):
    path = make_model("qwen2", tmp_path, max_shard_size="200KB", tokenizer_dir=tokenizer_source)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard_names = set(index["weight_map"].values())
    assert len(shard_names) >= 2
    assert all((path / name).is_file() for name in shard_names)
    assert not (path / "model.safetensors").exists()
    sharded = load_model(path).state_dict()
    single = load_model(models["qwen2"]).state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)


def test_llama3_rope_scaling_is_saved(tokenizer_source, tmp_path):
    path = make_model(
        "llama", tmp_path, rope_scaling="llama3", rope_theta=500000.0, tokenizer_dir=tokenizer_source
    )
    rope = read_config(path)["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert rope["factor"] == 8.0 and rope["low_freq_factor"] == 1.0 and rope["high_freq_factor"] == 4.0
    assert rope["original_max_position_embeddings"] < read_config(path)["max_position_embeddings"]
    assert load_model(path).config.rope_parameters["rope_type"] == "llama3"


def test_head_dim_and_init_std_options(tokenizer_source, tmp_path):
    path = make_model("qwen3", tmp_path, head_dim=32, init_std=0.02, tokenizer_dir=tokenizer_source)
    model = load_model(path)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert float(model.model.layers[0].mlp.up_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.2)


def test_make_model_leaves_global_rng_alone(tokenizer_source, tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model("llama", tmp_path, seed=7, tokenizer_dir=tokenizer_source)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
def test_greedy_logits_are_separated_and_varied(tokenizer_source, tmp_path, arch, tied):
    path = make_model(arch, tmp_path, tie_word_embeddings=tied, tokenizer_dir=tokenizer_source)
    model = load_model(path)
    generator = torch.Generator().manual_seed(2024)
    vocab_size = model.config.vocab_size
    for _ in range(3):
        prompt = torch.randint(4, vocab_size, (8,), generator=generator).tolist()
        new_tokens, gaps = greedy_rollout(model, prompt, steps=32)
        assert statistics.median(gaps) > 1e-2
        assert len(set(new_tokens)) >= 4


def test_cli_parser_builds_a_model(tokenizer_source, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tandem")
    add_cli_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "cli-model"
    arguments = parser.parse_args(
        ["make-model", "--arch", "qwen2", "--out", str(out), "--hidden-size", "32", "--num-layers", "1",
         "--num-heads", "2", "--num-kv-heads", "1", "--vocab-size", "512", "--tie-word-embeddings",
         "--rope-scaling", "llama3", "--seed", "3", "--max-shard-size", "50KB"]
    )
    assert arguments.func(arguments) == 0
    assert capsys.readouterr().out == f"{out}\n"
    config = read_config(out)
    assert config["model_type"] == "qwen2" and config["hidden_size"] == 32
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert (out / "model.safetensors.index.json").is_file()
    help_text = parser._subparsers._group_actions[0].choices["make-model"].format_help()
    for flag in ("--arch", "--out", "--head-dim", "--intermediate-size", "--max-position-embeddings"):
        assert flag in help_text


def test_cli_parser_rejects_unknown_arch():
    parser = argparse.ArgumentParser(prog="tandem")
    add_cli_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", "--arch", "no-such-arch", "--out", "x"])


@pytest.fixture
def counted_builds(monkeypatch, tokenizer_source):
    """Count make_model calls, building the demo at test size from the shared tokenizer."""
    calls = []
    real_make_model = make_model_module.make_model

    def small_make_model(arch, out_dir, **options):
        calls.append(out_dir)
        return real_make_model(arch, out_dir, tokenizer_dir=tokenizer_source)

    monkeypatch.setattr(make_model_module, "make_model", small_make_model)
    return calls


def test_ensure_demo_model_builds_once(counted_builds, tmp_path):
    first = ensure_demo_model(tmp_path)
    second = ensure_demo_model(tmp_path)
    assert first == second and len(counted_builds) == 1
    assert first.parent == tmp_path and "demo" in first.name
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert [entry.name for entry in tmp_path.iterdir()] == [first.name]


def test_ensure_demo_model_uses_environment_cache_dir(counted_builds, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert ensure_demo_model().parent == tmp_path / "cache"


def test_ensure_demo_model_concurrent_builders_agree(counted_builds, tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_demo_model(tmp_path))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert [entry.name for entry in tmp_path.iterdir()] == [results[0].name]
    assert AutoModelForCausalLM.from_pretrained(results[0]) is not None


def test_demo_model_defaults_are_bigger_llama():
    options = make_model_module.DEMO_MODEL_OPTIONS
    assert options["arch"] == "llama"
    assert options["hidden_size"] > 64 and options["vocab_size"] > 512 and options["num_layers"] > 2


def test_config_overrides_replace_the_architecture_defaults(tokenizer_source, tmp_path):
    """A benchmark shape sets a released MoE's expert sizes over qwen3_moe's tiny defaults."""
    path = make_model("qwen3_moe", tmp_path, tokenizer_dir=tokenizer_source, weights=False,
                      config_overrides={"num_experts": 128, "num_experts_per_tok": 8, "mlp_only_layers": []})
    config = read_config(path)
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["mlp_only_layers"]) == (128, 8, [])
    assert read_config(make_model("qwen3_moe", tmp_path / "default", tokenizer_dir=tokenizer_source,
                                  weights=False))["num_local_experts"] == 8
