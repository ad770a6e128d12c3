"""The offline ``LLM`` without a model serves the built-in demo model, as ``tandem serve`` does:
``LLM()`` and ``LLM(model="demo")`` load the same cached checkpoint, and its output matches
``transformers`` on it; a model that is neither a directory nor ``demo`` is an error naming ``model``
(``--model`` for the command line, which resolves models by the same rule)."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

from argparse import Namespace  # noqa: E402

import pytest  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.entrypoints.cli import resolve_model  # noqa: E402
from tests.support.oracle import Oracle, assert_matches  # noqa: E402


def test_llm_without_model_uses_the_demo_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(max_total_tokens=2048)
    demo_dir = llm.config.model
    assert os.path.basename(demo_dir).startswith("demo-") and os.path.dirname(demo_dir) == str(tmp_path / "cache")
    prompt = llm.get_tokenizer()("Once upon a time")["input_ids"]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True),
                          use_tqdm=False)[0]
    assert_matches(output.outputs[0], Oracle(demo_dir).greedy(prompt, 6), context="LLM() demo model")
    del llm

    named = LLM(model="demo", max_total_tokens=2048)
    assert named.config.model == demo_dir, "LLM(model='demo') must load the same cached demo model"
    del named

    with pytest.raises(ValueError, match="^model: 'no-such-dir' is not a directory"):
        LLM(model="no-such-dir")
    # tandem serve and generate follow the same rule: --model demo is the demo model
    assert resolve_model(Namespace(model="demo")) == (demo_dir, True)
    with pytest.raises(SystemExit, match="--model: 'no-such-dir' is not a directory"):
        resolve_model(Namespace(model="no-such-dir"))
