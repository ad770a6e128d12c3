"""Output processor and incremental detokenizer, on a hand-made byte-level BPE tokenizer."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402

from tandem.protocol import PositionLogprobs, RequestDelta  # noqa: E402
from tandem.frontend.detokenizer import IncrementalDetokenizer  # noqa: E402
from tandem.frontend.output_processor import OutputProcessor  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402

CORPUS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "café naïve résumé — 日本語のテキスト and emoji 🙂🚀 too.",
    "The quick brown fox jumps over the lazy dog. STOP here. The end.",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer trained here, with one special token <|endoftext|> (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream_deltas(request_id, token_ids, index=0, finish_reason="length", stop_reason=None, logprobs=False):
    """One delta per token; the last carries the finish reason."""
    deltas = []
    for position, token_id in enumerate(token_ids):
        last = position == len(token_ids) - 1
        new_logprobs = [PositionLogprobs([token_id, token_id, 5], [-0.5, -0.5, -1.5], 1)] if logprobs else None
        deltas.append(RequestDelta(
            request_id=request_id, index=index, new_token_ids=[token_id], new_logprobs=new_logprobs,
            num_prompt_tokens=3 if position == 0 else 0,
            finish_reason=finish_reason if last else None, stop_reason=stop_reason if last else None))
    return deltas


def run_all(processor, deltas):
    """Feed deltas one step each; collect outputs and stop-string finishes."""
    outputs, stopped = [], []
    for delta in deltas:
        step_outputs, step_stopped = processor.process([delta])
        outputs.extend(step_outputs)
        stopped.extend(step_stopped)
    return outputs, stopped


def test_detokenizer_never_emits_half_a_character(tokenizer):
    text = "日本語 🙂🚀 café"
    ids = encode(tokenizer, text)
    assert len(ids) > len(text) // 2, "the corpus must split multi-byte characters"
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, "hello"))
    pieces = [detokenizer.add_tokens([token_id]) for token_id in ids] + [detokenizer.finish()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_detokenizer_flushes_incomplete_character_at_finish(tokenizer):
    ids = encode(tokenizer, "ab🙂")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(detokenizer.add_tokens([token_id]) for token_id in ids[:-1])
    assert "\ufffd" not in emitted
    assert emitted + detokenizer.finish() == tokenizer.decode(ids[:-1])


def test_text_deltas_concatenate_to_full_text(tokenizer):
    processor = OutputProcessor(tokenizer)
    prompt_ids = encode(tokenizer, "hello")
    generated = encode(tokenizer, " world, café 日本語")
    processor.add_request("r1", "hello", prompt_ids, SamplingParams(max_tokens=len(generated)))
    outputs, stopped = run_all(processor, stream_deltas("r1", generated))
    assert stopped == []
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == " world, café 日本語"
    assert "".join(output.outputs[0].delta_text for output in outputs) == final.outputs[0].text
    assert sum((output.outputs[0].delta_token_ids for output in outputs), []) == generated
    assert final.outputs[0].token_ids == generated
    assert not processor.has_unfinished()


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    generated = encode(tokenizer, "the end") + [eos]
    for skip, expected in ((True, "the end"), (False, "the end<|endoftext|>")):
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, [1, 2], SamplingParams(skip_special_tokens=skip))
        outputs, _ = run_all(processor, stream_deltas("r", generated))
        assert outputs[-1].outputs[0].text == expected


def test_stop_token_hidden_unless_requested(tokenizer):
    eos = tokenizer.eos_token_id
    generated = encode(tokenizer, "fox") + [eos]
    for include, expected in ((False, "fox"), (True, "fox<|endoftext|>")):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        processor.add_request("r", None, [1], params)
        outputs, _ = run_all(processor, stream_deltas("r", generated, finish_reason="stop", stop_reason=eos))
        final = outputs[-1].outputs[0]
        assert (final.text, final.finish_reason, final.stop_reason) == (expected, "stop", eos)
        assert final.token_ids == generated


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_reports(tokenizer, include):
    generated = encode(tokenizer, "The quick brown fox. STOP here. The end.")
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["STOP", "never"], include_stop_str_in_output=include)
    processor.add_request("r", None, [1], params)
    outputs, stopped = run_all(processor, stream_deltas("r", generated))
    assert stopped == [("r", 0)]
    final = outputs[-1]
    assert final.finished
    expected = "The quick brown fox. STOP" if include else "The quick brown fox. "
    assert final.outputs[0].text == expected
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "STOP")
    streamed = "".join(output.outputs[0].delta_text for output in outputs)
    assert streamed == expected, "a stop string must never be streamed in part"
    # The engine may run ahead before it hears about the stop: late deltas are ignored.
    late, late_stopped = processor.process(stream_deltas("r", [5, 6]))
    assert late == [] and late_stopped == [] and not processor.has_unfinished()


def test_stop_string_in_the_engines_last_delta_is_not_reported(tokenizer):
    generated = encode(tokenizer, "the end. STOP")
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=["STOP"]))
    outputs, stopped = run_all(processor, stream_deltas("r", generated, finish_reason="length"))
    assert stopped == [], "the engine already ended this sequence"
    final = outputs[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("the end. ", "stop", "STOP")


def test_logprobs_in_vllm_shape(tokenizer):
    generated = encode(tokenizer, "hello world")
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(logprobs=1))
    outputs, _ = run_all(processor, stream_deltas("r", generated, logprobs=True))
    final = outputs[-1].outputs[0]
    assert len(final.logprobs) == len(generated)
    for token_id, position in zip(generated, final.logprobs):
        assert list(position)[0] == token_id
        assert position[token_id].rank == 1 and position[token_id].logprob == -0.5
        assert position[token_id].decoded_token == tokenizer.decode([token_id])
        if token_id != 5:
            assert position[5].rank == 2 and position[5].logprob == -1.5
    assert final.cumulative_logprob == pytest.approx(-0.5 * len(generated))


def test_prompt_logprobs_and_cached_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [7, 8, 9], SamplingParams(prompt_logprobs=0, max_tokens=1))
    delta = RequestDelta(request_id="r", new_token_ids=[10], num_prompt_tokens=3, num_cached_tokens=2,
                         prompt_logprobs=[None, PositionLogprobs([8], [-1.0], 3), PositionLogprobs([9], [-2.0], 1)],
                         finish_reason="length")
    (output,), _ = processor.process([delta])
    assert output.prompt_logprobs[0] is None
    assert output.prompt_logprobs[1][8].logprob == -1.0 and output.prompt_logprobs[1][8].rank == 3
    assert output.num_cached_tokens == 2


def test_n_choices_finish_together_and_deltas_are_per_choice(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(n=2, max_tokens=2))
    first = encode(tokenizer, "hello world")[:2]
    second = encode(tokenizer, "the end")[:2]
    (output,), _ = processor.process([RequestDelta(request_id="r", index=0, new_token_ids=first[:1]),
                                      RequestDelta(request_id="r", index=1, new_token_ids=second[:1])])
    assert not output.finished and [choice.delta_token_ids for choice in output.outputs] == [first[:1], second[:1]]
    (output,), _ = processor.process([RequestDelta(request_id="r", index=0, new_token_ids=first[1:],
                                                   finish_reason="length")])
    assert not output.finished
    assert output.outputs[0].finished() and output.outputs[1].delta_token_ids == []
    (output,), _ = processor.process([RequestDelta(request_id="r", index=1, new_token_ids=second[1:],
                                                   finish_reason="length")])
    assert output.finished and [choice.token_ids for choice in output.outputs] == [first, second]
    assert not processor.has_unfinished()


def test_outputs_are_snapshots(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams())
    (first,), _ = processor.process([RequestDelta(request_id="r", new_token_ids=[5])])
    processor.process([RequestDelta(request_id="r", new_token_ids=[6])])
    assert first.outputs[0].token_ids == [5] and first.outputs[0].delta_token_ids == [5]


def test_error_ends_every_choice(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(n=2))
    (output,), _ = processor.process([RequestDelta(request_id="r", finish_reason="error", error="boom")])
    assert output.finished and output.error == "boom"
    assert [choice.finish_reason for choice in output.outputs] == ["error", "error"]


def test_abort_and_unknown_requests(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        processor.add_request("r", None, [1], SamplingParams())
    processor.abort("r")
    processor.abort("never-added")
    assert not processor.has_unfinished()
    assert processor.process([RequestDelta(request_id="r", new_token_ids=[5])]) == ([], [])


def test_detokenize_off_gives_ids_only(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(detokenize=False))
    (output,), _ = processor.process([RequestDelta(request_id="r", new_token_ids=[5, 6], finish_reason="length")])
    assert output.outputs[0].text == "" and output.outputs[0].token_ids == [5, 6]
