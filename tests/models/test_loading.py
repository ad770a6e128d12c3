"""Loading model directories: sharded safetensors, dummy weights, dtypes, tied embeddings,
and clear errors for what cannot be loaded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def test_sharded_checkpoint_loads_and_equals_single_file(tmp_path, tokenizer_dir, model_dirs):
    from tandem.tools.make_model import make_model

    sharded = make_model("llama", tmp_path / "sharded", seed=1, tokenizer_dir=tokenizer_dir,
                         rope_scaling="llama3", max_shard_size="100KB")
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    assert len(list(Path(sharded).glob("*.safetensors"))) > 1
    prompt = list(range(3, 30))
    a = LLM(model=str(sharded), max_total_tokens=512).generate([prompt], GREEDY)[0].outputs[0]
    b = LLM(model=model_dirs["llama"], max_total_tokens=512).generate([prompt], GREEDY)[0].outputs[0]
    assert a.token_ids == b.token_ids


def test_dummy_weights_run(model_dirs):
    llm = LLM(model=model_dirs["qwen3"], load_format="dummy", max_total_tokens=512)
    (output,) = llm.generate([list(range(3, 20))], GREEDY)
    assert len(output.outputs[0].token_ids) == 8
    assert all(torch.isfinite(torch.tensor(lp.logprob)) for pos in output.outputs[0].logprobs for lp in pos.values())
    llm.engine.check_all_free()


def test_bfloat16_runs_close_to_float32(model_dirs):
    prompt = list(range(3, 40))
    fp32 = LLM(model=model_dirs["llama"], max_total_tokens=512, dtype="float32")
    bf16 = LLM(model=model_dirs["llama"], max_total_tokens=512, dtype="bfloat16")
    assert bf16.engine.model_info.dtype == torch.bfloat16
    a = fp32.generate([prompt], GREEDY)[0].outputs[0]
    b = bf16.generate([prompt], GREEDY)[0].outputs[0]
    assert a.token_ids[0] == b.token_ids[0]
    # bf16 keeps 8 significant bits: on this model's wide logits (|logit| ~ 10-30) that is an
    # absolute error of ~0.1; 0.3 nats still catches a wrong cast or a broken bf16 path.
    assert abs(a.logprobs[0][a.token_ids[0]].logprob - b.logprobs[0][a.token_ids[0]].logprob) < 0.3


def test_tied_embeddings_share_one_tensor(model_dirs):
    llm = LLM(model=model_dirs["qwen2"], max_total_tokens=256)
    config = json.loads((Path(model_dirs["qwen2"]) / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert llm.engine.model.lm_head.weight is llm.engine.model.model.embed_tokens.weight


def test_chat_and_text_prompts(model_dirs):
    llm = LLM(model=model_dirs["llama"], max_total_tokens=1024)
    (chat,) = llm.chat([{"role": "user", "content": "hello there"}], GREEDY)
    assert chat.prompt_token_ids and chat.outputs[0].text is not None
    (text,) = llm.generate("the quick brown fox", GREEDY)
    assert text.prompt == "the quick brown fox" and len(text.outputs[0].token_ids) == 8


@pytest.mark.parametrize("options, field", [
    (dict(page_size=0), "page_size"),
    (dict(dtype="float8"), "dtype"),
    (dict(load_format="pickle"), "load_format"),
    (dict(max_num_seqs=0), "max_num_seqs"),
])
def test_bad_engine_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(model="unused", **options)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="^model:"):
        LLM(model=str(tmp_path / "nope"))
