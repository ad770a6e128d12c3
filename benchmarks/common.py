"""What the benchmarks share: model shapes, model directories, the machine's measured ceilings
and the roofline of a workload (the fewest bytes and FLOPs it must spend, over those ceilings).
"""
from __future__ import annotations

import gc
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


# name: (architecture, make_model shape arguments)
SHAPES = {
    # The host's per-sequence work on a CPU: a forward pass that costs next to nothing.
    "micro": ("llama", dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
                            vocab_size=512, max_position_embeddings=4096)),
    "tiny-30m": ("llama", dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                               intermediate_size=1536, vocab_size=8192)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1000000.0, max_position_embeddings=40960)),
    "llama3-8b": ("llama", dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                intermediate_size=14336, vocab_size=128256, rope_scaling="llama3",
                                rope_theta=500000.0, max_position_embeddings=131072)),
    # Qwen3-30B-A3B: 48 layers, every one sparse (128 experts of 768, 8 per token, renormalised).
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                        intermediate_size=6144, vocab_size=151936, rope_theta=1000000.0,
                                        max_position_embeddings=40960,
                                        config_overrides=dict(num_experts=128, num_experts_per_tok=8,
                                                              moe_intermediate_size=768, norm_topk_prob=True,
                                                              decoder_sparse_step=1, mlp_only_layers=[]))),
    # Draft shapes for benchmarks/spec_decode.py (the same vocabulary as their targets).
    "llama3.2-1b": ("llama", dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                  intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                                  rope_scaling="llama3", rope_theta=500000.0, max_position_embeddings=131072)),
    "tiny-draft": ("llama", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=256, vocab_size=8192)),
}


def add_model_arguments(parser) -> None:
    """``--shape``, ``--model``, ``--dtype``: the model a benchmark runs (see ``resolve_model_arguments``)."""
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="model shape (default: tiny-30m on CPU, llama3-8b on a GPU)")
    parser.add_argument("--model", help="model directory (default: build the shape)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on a GPU")


def resolve_model_arguments(args) -> bool:
    """Fill in the model defaults for this machine; True on a GPU (random weights made there:
    ``load_format`` dummy unless ``--model`` names a directory)."""
    gpu = torch.cuda.is_available()
    args.shape = args.shape or ("llama3-8b" if gpu else "tiny-30m")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.load_format = "dummy" if gpu and not args.model else "auto"
    return gpu


def model_dir_for(shape: str, load_format: str, quantize: str | None = None) -> str:
    """A model directory of ``shape``: with random float32 weights (``auto``), or config and
    tokenizer only (``dummy``: the engine makes random weights on its device). ``quantize``
    (``make_model``'s formats, e.g. ``"fp8"``: 128x128 block-scaled): an FP8 checkpoint, or with
    ``dummy`` a config announcing one (random FP8 weights). Built once."""
    from tandem.tools.make_model import make_model

    arch, options = SHAPES[shape]
    kind = "dummy" if load_format == "dummy" else "weights"
    out = Path(tempfile.gettempdir()) / f"tandem-bench-{shape}-{kind}{'-' + quantize if quantize else ''}"
    config = out / "config.json"
    if not config.is_file() or "architectures" not in json.loads(config.read_text()):
        make_model(arch, out, seed=0, weights=load_format != "dummy", quantize=quantize, **options)
    return str(out)


def vocab_size_of(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def release(llm) -> None:
    """Give an engine's device memory back before the next system loads its model (CUDA graphs
    and the engine's own references form cycles that only the collector breaks)."""
    engine, llm.engine = llm.engine, None
    engine.shutdown()
    del engine
    gc.collect()
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compiled_kernel_variants() -> dict[str, int]:
    """Triton kernel name -> how many specialisations this process compiled (CUDA only). More
    than one or two for a kernel means some per-step value (a size, a stride, a pointer's
    alignment) is specialised on, and steps that meet a new one stall on a compile."""
    import importlib
    import pkgutil

    import tandem.kernels

    counts: dict[str, int] = {}
    for module_info in pkgutil.iter_modules(tandem.kernels.__path__):
        module = importlib.import_module(f"tandem.kernels.{module_info.name}")
        for name, value in vars(module).items():
            caches = getattr(value, "device_caches", None)
            if caches and getattr(value, "__module__", module.__name__) == module.__name__:
                variants = sum(len(entry[0]) for entry in caches.values())
                if variants:
                    counts[name] = variants
    return counts


@dataclass(frozen=True)
class Ceilings:
    """Measured on this machine: memory bandwidth (bytes read + written per second by a large
    copy) and matrix rate (FLOP/s of a large matrix product in the benchmark's dtype)."""
    bandwidth: float
    flops: float
    device: str

    @classmethod
    def measure(cls, dtype: torch.dtype, fp8: bool = False) -> "Ceilings":
        """``fp8``: the matrix rate is FP8's (``torch._scaled_mm``, CUDA), the rate FP8 weights'
        products run at (the roofline then counts attention's FLOPs at it too)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        numel = (1 << 28) if device == "cuda" else (1 << 25)
        source = torch.randn(numel, device=device)
        target = torch.empty_like(source)
        copy_seconds = best_seconds(lambda: target.copy_(source))
        size = 8192 if device == "cuda" else 1024
        matrix_dtype = dtype if device == "cuda" else torch.float32
        left = torch.randn(size, size, device=device, dtype=matrix_dtype)
        right = torch.randn(size, size, device=device, dtype=matrix_dtype)
        matmul_seconds = best_seconds(lambda: left @ right)
        if fp8 and device == "cuda":
            matmul_seconds = fp8_matmul_seconds(size)
        name = torch.cuda.get_device_name() if device == "cuda" else f"CPU x{torch.get_num_threads()} threads"
        name += ", FP8 products" if fp8 and device == "cuda" else ""
        return cls(bandwidth=2 * source.numel() * source.element_size() / copy_seconds,
                   flops=2 * size ** 3 / matmul_seconds, device=name)

    def describe(self) -> str:
        return (f"{self.device}: measured copy bandwidth {self.bandwidth / 1e12:.2f} TB/s, "
                f"matrix rate {self.flops / 1e12:.1f} TFLOP/s")


def fp8_matmul_seconds(size: int) -> float:
    """Seconds of one ``size``-cubed FP8 product (``torch._scaled_mm``, row-wise scales, bf16
    out, fast accumulation as the engine's products): the FP8 tensor rate the FP8 GEMMs are held
    against."""
    left = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    right = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    left_scale = torch.ones(size, 1, device="cuda")
    right_scale = torch.ones(1, size, device="cuda")
    return best_seconds(lambda: torch._scaled_mm(left, right.t(), scale_a=left_scale, scale_b=right_scale,
                                                 out_dtype=torch.bfloat16, use_fast_accum=True))


QUANTIZATION_MODES = ("fp8", "fp8-block")


def add_quantization_argument(parser) -> None:
    parser.add_argument("--quantization", choices=QUANTIZATION_MODES, default=None,
                        help="tandem's weights: fp8 quantizes linear weights per output channel at load "
                             "(scaled_mm products); fp8-block builds the shape as a 128x128 block-scaled FP8 "
                             "checkpoint (Triton block GEMM, FP8 experts). With --load-format dummy: random FP8 "
                             "weights. The roofline counts FP8 weight bytes and the measured FP8 matrix rate. An "
                             "FP8 checkpoint (--model) is FP8 without it")


def quantized_model_dir(args) -> tuple[str, str | None]:
    """(model directory, tandem's ``quantization`` option) for ``--model``/``--shape`` and
    ``--quantization``."""
    if args.model:
        return args.model, "fp8" if args.quantization == "fp8" else None
    if args.quantization == "fp8-block":
        return model_dir_for(args.shape, args.load_format, quantize="fp8"), None
    return model_dir_for(args.shape, args.load_format), args.quantization


def is_fp8_model(model_dir: str, quantization) -> bool:
    """Whether tandem runs ``model_dir`` with FP8 weights (the option, or its quantization_config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return quantization is not None or "quantization_config" in config


def best_seconds(function, repeat: int = 10, warm_up: bool = True) -> float:
    """The fastest of ``repeat`` timed calls (device work included), after one untimed call."""
    if warm_up:
        function()
        synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class RoutedExperts:
    """A model's routed experts (``FusedExperts``), all layers together: their bytes, and how
    many experts each layer has and each token picks."""
    weight_bytes: int = 0
    num_parameters: int = 0
    num_experts: int = 1
    top_k: int = 0

    @classmethod
    def of_model(cls, model, config) -> "RoutedExperts":
        from tandem.layers.moe import FusedExperts

        experts = [module for module in model.modules() if isinstance(module, FusedExperts)]
        if not experts:
            return cls()
        parameters = [p for module in experts for p in module.parameters()]
        return cls(sum(p.numel() * p.element_size() for p in parameters), sum(p.numel() for p in parameters),
                   experts[0].num_experts, int(config.num_experts_per_tok))

    def fraction_read(self, batch_size: int) -> float:
        """Expected share of the experts a step of ``batch_size`` tokens reads, routing uniform
        and independent (random weights route near uniformly; a trained router's skew reads fewer)."""
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch_size


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model: weight bytes every decode step reads (``weight_bytes``;
    routed experts apart, in ``experts``: a step reads those its tokens pick), matrix FLOPs per
    token (routed experts: a token's ``top_k``), attention FLOPs per (query, key) pair, and state
    bytes per cached token."""
    weight_bytes: int
    flops_per_token: float
    attention_flops_per_pair: float
    state_bytes_per_token: float
    experts: RoutedExperts = RoutedExperts()

    def decode_weight_bytes(self, batch_size: int) -> float:
        """Weight bytes a decode step of ``batch_size`` sequences reads."""
        return self.weight_bytes + self.experts.weight_bytes * self.experts.fraction_read(batch_size)

    @classmethod
    def of_engine(cls, engine) -> "ModelCost":
        from tandem.kv.planner import bytes_per_page

        model = engine.model
        parameters = {id(p): p for p in model.parameters()}
        total = sum(p.numel() * p.element_size() for p in parameters.values())
        count = sum(p.numel() for p in parameters.values())
        embedding = model.model.embed_tokens.weight
        if model.lm_head.weight is not embedding:  # an untied embedding reads only its rows
            total -= embedding.numel() * embedding.element_size()
            count -= embedding.numel()
        config = engine.hf_config
        experts = RoutedExperts.of_model(model, config)
        total -= experts.weight_bytes
        count -= experts.num_parameters * (1.0 - experts.top_k / experts.num_experts)  # a token runs top_k of them
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # (one rank's heads under tensor parallelism: the model's parameters above are its shard's)
        heads = config.num_attention_heads // engine.config.tensor_parallel_size
        attention = 4 * config.num_hidden_layers * heads * head_dim
        page_size = engine.coordinator.page_size
        return cls(total, 2.0 * count, attention, bytes_per_page(engine.registry, page_size) / page_size, experts)

    def roofline_seconds(self, ceilings: Ceilings, prompt_lengths: list[int], output_lengths: list[int]) -> float:
        """Fewest seconds for the workload: each prompt's FLOPs at the matrix rate, then each
        decode step at the slower of its bytes (weights + every running request's state) over
        the bandwidth and its FLOPs over the matrix rate."""
        prefill_flops = sum(length * self.flops_per_token + self.attention_flops_per_pair * length * (length + 1) / 2
                            for length in prompt_lengths)
        seconds = prefill_flops / ceilings.flops
        for step in range(1, max(output_lengths)):  # the first output token comes from the prefill
            contexts = [prompt + step for prompt, output in zip(prompt_lengths, output_lengths) if output > step]
            if not contexts:
                break
            step_bytes = self.decode_weight_bytes(len(contexts)) + self.state_bytes_per_token * sum(contexts)
            step_flops = len(contexts) * self.flops_per_token + self.attention_flops_per_pair * sum(contexts)
            seconds += max(step_bytes / ceilings.bandwidth, step_flops / ceilings.flops)
        return seconds
