"""FP8 products against the same checkpoint's dequantized weights, teacher-forced
(``tests/support/fp8_agreement.py``): on a CPU, ``quantized_compute="fp8"`` runs the PyTorch references
of the GPU kernels (activations quantized to e4m3 per 1x128 group, float32 products), so this
checks the comparison's logic and its bounds against the FP8 algorithm's own error; the GPU
test (``tests/gpu/test_gpu_fp8.py``) runs the same comparison on the kernels."""
from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.support.fp8_agreement import assert_within_fp8_error, compare, compare_decoded, long_prompts, score

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# Matrices at std 0.05 (0.8 / sqrt(hidden)): tame enough that a small perturbation is not
# amplified layer by layer (the default wide init makes attention nearly one-hot, so a 3% change
# of a score swaps which key wins), logits spread ~0.8.
SHAPE = dict(hidden_size=256, intermediate_size=320, num_heads=4, num_kv_heads=2, init_std=0.05)
# Measured for this model (llama, 128x128 blocks): agreement 0.89, mean error 0.046, p99 0.16,
# flips at reference margins up to 0.24. The bounds leave room for another seed, not for a bug:
# ignoring the scales (below) gives errors of whole nats.
BOUNDS = dict(agreement=0.8, mean_error=0.1, tail_error=0.3, flip_margin=0.5)
OPTIONS = dict(device="cpu", dtype="float32", page_size=16, max_total_tokens=4096, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def block_scaled_llama(tmp_path_factory, tokenizer_dir):
    from tandem.tools.make_model import make_model

    return str(make_model("llama", tmp_path_factory.mktemp("fp8_llama"), seed=1, quantize="fp8",
                          tokenizer_dir=tokenizer_dir, **SHAPE))


def test_fp8_products_stay_within_fp8_error_teacher_forced(block_scaled_llama):
    sequences = long_prompts(3, 200, seed=5)
    prompts = [sequence[:40] for sequence in sequences]
    fp8 = LLM(model=block_scaled_llama, quantized_compute="fp8", **OPTIONS)
    assert fp8.engine.model_info.quantization == "fp8:block-128x128/fp8"
    fp8_scores = score(fp8, sequences)
    decoded = fp8.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True))
    fp8.engine.check_all_free()
    reference = LLM(model=block_scaled_llama, quantized_compute="dequantized", **OPTIONS)
    reference_scores = score(reference, sequences)
    continued = [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, decoded)]
    reference_continued = score(reference, continued)
    prefill = compare(fp8_scores, reference_scores, sequences)
    assert prefill.positions == sum(len(sequence) - 1 for sequence in sequences)
    assert 0 < prefill.mean_error  # FP8 activations do change the products
    assert_within_fp8_error(prefill, "scored", **BOUNDS)
    decode = compare_decoded(decoded, reference_continued, prompts)
    assert decode.positions == 3 * 24
    assert_within_fp8_error(decode, "decoded", **BOUNDS)
    # Each side against itself: the comparison reads positions consistently.
    same = compare(reference_scores, reference_scores, sequences)
    assert same.agreement == 1.0 and max(same.errors) == 0.0

    # Scales ignored (every weight read as its raw FP8 value): far outside the bounds.
    for module in fp8.engine.model.modules():
        if getattr(module, "weight_method", None) is not None:
            module.weight_scale.fill_(1.0)
    with pytest.raises(AssertionError):
        assert_within_fp8_error(compare(score(fp8, sequences), reference_scores, sequences), "unscaled", **BOUNDS)
