"""The few-token FP8 product (``tandem/kernels/fp8_weight_only.py``) against its PyTorch
reference: interpreted on CPU with tiny, odd shapes (partial row strips, partial K steps, block
scales of 16 and 32 inputs, per-row scales, split-K); on a GPU (``-m gpu``) at Llama-3.1-8B
shapes with the tiles the dispatch picks, eager and replayed from a CUDA graph, and the FP8
linear method taking this path at decode sizes only."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_weight_only import (_ARRIVALS, MAX_TOKENS, WeightOnlyConfig, weight_only_config, weight_only_matmul,
                                            weight_only_matmul_reference)
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)
from tests.support.kernels import quantized_weight

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.mark.parametrize("tokens, rows, features, group, config", [
    (1, 40, 72, 16, WeightOnlyConfig(block_n=16, block_k=32, split=1)),  # partial strip, partial K step
    (5, 24, 100, None, WeightOnlyConfig(block_n=16, block_k=32, split=2)),  # per-row scales, split-K
    (16, 33, 96, 32, WeightOnlyConfig(block_n=32, block_k=64, split=3)),  # two groups a step, 3-way split
    # One and two tokens with tiles given: the tensor-core tile (without, ``gemv.py``'s kernels).
    (1, 40, 100, None, WeightOnlyConfig(block_n=16, block_k=32, split=1)),  # per-row, partial strip and step
    (2, 24, 96, 16, WeightOnlyConfig(block_n=16, block_k=64, split=2)),  # four groups a step, split-K
    (2, 33, 72, 32, WeightOnlyConfig(block_n=16, block_k=32, split=1)),  # a partial group at the end
    (1, 17, 200, 32, None),  # the kernel and tiles the dispatch picks (gemv.py's)
])
def test_weight_only_product_equals_reference(tokens, rows, features, group, config):
    weight, scale = quantized_weight(rows, features, group, seed=tokens)
    hidden = torch.randn(tokens, features, generator=torch.Generator().manual_seed(7))
    expected = weight_only_matmul_reference(hidden, weight, scale, group)
    actual = weight_only_matmul(hidden, weight, scale, group, config)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # Split-K: the strips' last programs summed in split order and set their counters back, so
    # the next launch sums the same way.
    assert torch.equal(weight_only_matmul(hidden, weight, scale, group, config), actual)
    assert all(not counters.any() for counters in _ARRIVALS.values())
    # The scales count: the same weight read unscaled is another product.
    assert not torch.allclose(expected, weight_only_matmul_reference(hidden, weight, torch.ones_like(scale), group))


# (the interpreter warns where float16 overflows: the point of the 1e6 activation)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("group", [None, 32])
def test_float16_operands_and_their_float32_redo(group):
    """The GPU's operand type, interpreted: 16-bit activations and the FP8 weight in float16 on
    the tensor cores give the reference to the output's rounding; an activation past float16's
    range (here 1e6) sends its programs through the product again in float32, so the output is
    the reference's, finite, rather than the infinities float16 makes of it."""
    weight, scale = quantized_weight(40, 96, group, seed=3)
    hidden = torch.randn(3, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    config = WeightOnlyConfig(block_n=16, block_k=32, split=1, dot="float16")
    for value in (None, 1e6):
        if value is not None:
            hidden[1, 5] = value
        expected = weight_only_matmul_reference(hidden, weight, scale, group)
        actual = weight_only_matmul(hidden, weight, scale, group, config)
        assert torch.isfinite(actual).all()
        step = 2.0 ** (torch.floor(torch.log2(expected.float().abs().clamp_min(1e-30))) - 7)  # a bfloat16 step
        assert ((actual.float() - expected.float()).abs() <= step).all()


def test_weight_only_tiles_fill_an_h100():
    """The tiles of the sweep behind ``weight_only_config`` (132 SMs): every Llama-3.1-8B
    projection, and a small N, makes 256 programs or more (about two per SM), except per-row
    scales on short rows, never split (there split-K cost more than it gave)."""
    for rows, features in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (512, 4096)]:
        for group in (None, 128):
            config = weight_only_config(rows, features, group, 132)
            programs = -(-rows // config.block_n) * config.split
            assert programs >= (16 if group is None and features < 8192 else 256), (rows, features, group, config)
            assert config.block_k >= 128 and config.block_n in (32, 64)
            assert group is None or group % config.block_k == 0 or config.block_k % group == 0
    assert weight_only_config(4096, 14336, None, 132).split == 4  # long rows split (the down projection)
    assert weight_only_config(4096, 4096, 128, 132).split == 4 and weight_only_config(6144, 4096, None, 132).split == 1
    assert weight_only_config(6144, 4096, None, 132).block_k == 256  # per-row, short rows: 256-input steps
    assert weight_only_config(28672, 4096, None, 132) == WeightOnlyConfig(64, 128, 1)  # but gate/up: 128


def test_weight_only_refuses_more_than_its_tokens():
    weight, scale = quantized_weight(16, 32, None, seed=1)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        weight_only_matmul(torch.zeros(MAX_TOKENS + 1, 32), weight, scale, None)


LLAMA_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("rows, features", LLAMA_8B_SHAPES + [(512, 4096)])
def test_gpu_weight_only_product_equals_reference(rows, features, tokens, group):
    weight, scale = quantized_weight(rows, features, group, seed=3, device="cuda")
    hidden = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
    expected = weight_only_matmul_reference(hidden, weight, scale, group).float()
    actual = weight_only_matmul(hidden, weight, scale, group).float()
    # bfloat16 output (8 bits): well inside; no activation rounding on this path.
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [None, 128])
def test_gpu_linear_method_takes_the_weight_only_path_at_decode_sizes_in_a_graph(group):
    """Both scale layouts take the weight-only path at decode sizes (up to 16 tokens), the
    activation-quantized GEMMs above."""
    from tandem.quantization.linear_method import Fp8LinearMethod

    weight, scale = quantized_weight(4096, 4096, group, seed=4, device="cuda")
    module = torch.nn.Module()
    module.weight, module.weight_scale = weight, scale
    method = Fp8LinearMethod(group)
    for tokens in (1, 2, 3, 16, 17):
        hidden = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        exact = weight_only_matmul_reference(hidden, weight, scale, group).float()
        error = (method.apply(module, hidden, None).float() - exact).abs().max() / exact.abs().max()
        # weight-only: bfloat16 rounding (< 1%); otherwise activations in e4m3 (a few %)
        weight_only = tokens <= MAX_TOKENS
        assert (error < 0.01) == weight_only, (tokens, float(error))
    static = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    eager = method.apply(module, static, None)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        method.apply(module, static, None)  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = method.apply(module, static, None)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(output, eager, rtol=1e-3, atol=1e-3 * float(eager.abs().max()))


def weight_only_request(group, split, unaligned=("M",)) -> dict:
    from tandem.kernels.fp8_weight_only import WHOLE_ROW
    from tests.support.triton_aot import compile_request

    signature = {"x": "*bf16", "w": "*fp8e4nv", "w_scale": "*fp32", "out": "*bf16", "partials": "*fp32",
                 "arrivals": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_w": "i32",
                 "stride_out": "i32", "scale_columns": "i32", "K_PER_SPLIT": "i32"}
    constexprs = {"GROUP": group or WHOLE_ROW, "BLOCK_M": MAX_TOKENS, "BLOCK_N": 32, "BLOCK_K": 128 if group else 256,
                  "SUB_K": min(group or 256, 256), "SPLIT_SUM": split, "DOT": "float16"}
    return compile_request("tandem.kernels.fp8_weight_only", "_weight_only_gemm", signature, constexprs, warps=4,
                           stages=4, unaligned=unaligned)


def test_weight_only_kernel_streams_the_weight_with_pipelined_16_byte_copies_on_h100():
    """What the bandwidth target rests on, checked without a GPU (``tests/support/triton_aot.py``): the
    weight reaches shared memory through asynchronous 16-byte copies several steps ahead
    (software pipelining), for block and per-row scales, plain and split-K; not byte by byte,
    which is what the kernel compiles to when a program's K range is of unknown alignment (the
    JIT then specialises nothing on it: why ``K_PER_SPLIT`` is specialised)."""
    pytest.importorskip("triton")
    from tests.support.triton_aot import ptx_for_h100

    *aligned, unaligned = ptx_for_h100([weight_only_request(128, False), weight_only_request(None, True),
                                        weight_only_request(128, False, unaligned=("M", "K_PER_SPLIT"))])
    for ptx in aligned:
        copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line]
        assert copies and all(", 0x10" in line for line in copies), copies[:3]
        assert ptx.count("cp.async.commit_group") >= 4  # several steps in flight
        assert "ld.global.b8" not in ptx and "mma.sync" in ptx
    assert "cp.async" not in unaligned and "ld.global.b8" in unaligned
