"""Engine configuration: one frozen dataclass, filled from the offline API or the CLI."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Optional

from tandem.validation import require

if TYPE_CHECKING:
    from tandem.transfer.config import TransferConfig

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy")
QUANTIZATION_CHOICES = ("fp8",)  # the quantization option (tandem/quantization)
QUANTIZED_COMPUTE_CHOICES = ("auto", "fp8", "dequantized")
INDEXER_CACHE_DTYPE_CHOICES = ("fp8", "float32")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")
KV_CACHE_LAYOUT_CHOICES = ("auto", "layer-major", "page-major")
HOST_CACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREEMPTION_MODES = ("swap", "recompute")
SPECULATIVE_METHOD_CHOICES = ("mtp", "draft")
MAX_SPECULATIVE_TOKENS = 16
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")  # vLLM's names (tandem/engine/ranks/backends.py)
RAY_PLACEMENT_STRATEGIES = ("pack", "spread", "strict_pack", "strict_spread")  # Ray's, in lower case
RAY_MISSING = ("'ray' needs the ray package: pip install \"tandem[ray]\" (or --distributed-executor-backend mp: "
               "the ranks as processes of this host)")


def sanitize_enabled() -> bool:
    """Sanitizer mode (docs/design.md I5, I6) is on when ``TANDEM_SANITIZE=1``."""
    return os.environ.get("TANDEM_SANITIZE", "0") not in ("", "0", "false", "False")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    load_format: str = "auto"
    # Weight quantization at load: "fp8" quantizes a bf16/fp32 checkpoint's linear weights per
    # output channel (vLLM's --quantization fp8). None: as the checkpoint is (an FP8 checkpoint's
    # quantization_config is read from config.json either way; tandem/quantization).
    quantization: Optional[str] = None
    # How quantized weights compute: "fp8" (FP8 weights and FP8 products, activations quantized
    # on the fly; on a CPU through the PyTorch references), "dequantized" (weights dequantized at
    # load to the model dtype: the reference FP8 products are compared with), "auto": fp8 on
    # CUDA, dequantized on a CPU.
    quantized_compute: str = "auto"
    device: str = "auto"
    seed: int = 0
    # State system.
    page_size: int = 16
    max_total_tokens: Optional[int] = None  # pool size in tokens; None: from the memory budget
    kv_cache_memory_bytes: Optional[int] = None  # explicit budget for all state buffers
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of device memory tandem may use
    cpu_kv_cache_fraction: float = 0.1  # on CPU: fraction of available host memory for state
    enable_prefix_caching: bool = True
    # Sparse-attention (DSA) indexer key cache: "fp8" (e4m3 keys + FP32 scales, page-major, as
    # deployed) or "float32" (unquantised; bit-for-bit comparable with the reference).
    indexer_cache_dtype: str = "fp8"
    # Paged K/V of attention layers (full, sliding window, hybrids' attention): "auto" (the model
    # dtype) or "fp8"/"fp8_e4m3" (float8 e4m3, scale 1.0, saturated at +-448; see kv/spec.py).
    kv_cache_dtype: str = "auto"
    # Device state pools: "layer-major" (one tensor per group, layer and buffer kind) or
    # "page-major" (one allocation per group whose page is one block holding that page of every
    # buffer of the group, so a run of pages is one run of memory: one PD write per run and
    # group). "auto": page-major on a PD server (``transfer`` set), layer-major otherwise.
    kv_cache_layout: str = "auto"
    # Tiers behind the prefix cache (kv/tiers): host memory in GB (2**30 bytes; 0: off), when
    # device pages are copied there, and a disk directory behind it (shared by engines that name
    # the same one) with its size cap in GB.
    host_cache_size: float = 0.0
    host_cache_write_policy: str = "write_through"
    disk_cache_dir: Optional[str] = None
    disk_cache_size: float = 16.0
    # Decode offload: every page that fills while a request decodes is copied device → host →
    # the disk tier (the store shared with the prefill servers) as it fills, so the next turn
    # of a conversation hits it on any prefill server. Needs disk_cache_dir and write_through.
    decode_offload: bool = False
    # Scheduler. Preemption by "swap" (to the host tier; the default when one exists) or
    # "recompute" (the default without one, and the fallback when the host tier is full).
    preemption_mode: Optional[str] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # SLO-aware chunked prefill: in a step with running decodes, prefill takes only as many tokens
    # as keep the predicted step time (the decodes' inter-token gap) within this many
    # milliseconds (scheduler/step_time.py); None: prefill takes the whole token budget.
    max_itl_ms: Optional[float] = None
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    # CUDA graphs for decode steps (CUDA only): off with enforce_eager; captured at these batch
    # sizes (None: 1, 2, 4, 8, 16, 32, ... up to max_num_seqs, see worker/cuda_graphs.py).
    enforce_eager: bool = False
    # Overlapped engine loop: the host schedules and prepares step N+1 while the device runs
    # step N. None: on for CUDA devices (on a CPU the forward pass is synchronous anyway).
    async_scheduling: Optional[bool] = None
    cuda_graph_sizes: Optional[tuple[int, ...]] = None
    # CUDA graphs for steps with a prompt chunk, around their attention layers, which run eagerly
    # (worker/mixed_graphs.py; attention-only models, every rank alike under tensor parallelism):
    # captured for steps of up to these token counts (None: 8 ... 1,024, under tensor
    # parallelism ... 4,096, capped at max_num_batched_tokens); off with enforce_eager or
    # mixed_step_graphs=False.
    mixed_step_graphs: bool = True
    mixed_step_graph_sizes: Optional[tuple[int, ...]] = None
    sanitize: Optional[bool] = None  # None: from TANDEM_SANITIZE
    # Speculative decoding (tandem/spec_decode): "mtp" (the checkpoint's next-n layers: DeepSeek-V3,
    # V3.2, GLM-5) or "draft" (``speculative_model``, a smaller model with the same vocabulary);
    # None: off. ``num_speculative_tokens`` drafts are verified per step (default for "mtp": the
    # checkpoint's number of next-n layers). A draft model alone implies "draft".
    speculative_method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    speculative_model: Optional[str] = None
    # Prefill/decode disaggregation: None for a colocated engine (see tandem/transfer/config.py).
    transfer: Optional["TransferConfig"] = None
    # Tensor parallelism (tandem/parallel): one engine process per rank (rank i on cuda:i; on a
    # CPU every rank on the CPU, over gloo on 127.0.0.1); rank 0 schedules and samples.
    tensor_parallel_size: int = 1
    # On CUDA, sums of up to a few MiB between the ranks go through peer buffers (one-shot and
    # two-shot all-reduce over symmetric memory; limits from TANDEM_ALLREDUCE_*, docs/allreduce.md)
    # instead of NCCL; True: NCCL for every sum.
    disable_custom_all_reduce: bool = False
    # How ranks 1..N-1 run when tensor_parallel_size > 1: "mp", worker processes of this host;
    # "ray", worker actors on a Ray cluster (RAY_ADDRESS, or a local one), placed by a placement
    # group of one bundle per rank with ``ray_placement_strategy`` (rank 0, the engine core, stays
    # in this process: its bundle is on this node). With one rank nothing is started either way.
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = "pack"
    # Structured outputs: a request whose grammar has not compiled within this many seconds is
    # rejected (the server answers 400).
    structured_outputs_compile_timeout: float = 30.0

    @property
    def fp8_compute(self) -> Optional[bool]:
        """``quantized_compute`` for ``build_model``: None (auto: by device), True or False."""
        return {"auto": None, "fp8": True, "dequantized": False}[self.quantized_compute]

    def __post_init__(self) -> None:
        require(self.dtype in DTYPE_CHOICES, "dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        require(self.load_format in LOAD_FORMAT_CHOICES, "load_format",
              f"must be one of {LOAD_FORMAT_CHOICES}, got {self.load_format!r}")
        require(self.quantization is None or self.quantization in QUANTIZATION_CHOICES, "quantization",
                f"must be one of {QUANTIZATION_CHOICES} or None, got {self.quantization!r}")
        require(self.quantized_compute in QUANTIZED_COMPUTE_CHOICES, "quantized_compute",
                f"must be one of {QUANTIZED_COMPUTE_CHOICES}, got {self.quantized_compute!r}")
        require(self.indexer_cache_dtype in INDEXER_CACHE_DTYPE_CHOICES, "indexer_cache_dtype",
              f"must be one of {INDEXER_CACHE_DTYPE_CHOICES}, got {self.indexer_cache_dtype!r}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPE_CHOICES, "kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}")
        require(self.kv_cache_layout in KV_CACHE_LAYOUT_CHOICES, "kv_cache_layout",
                f"must be one of {KV_CACHE_LAYOUT_CHOICES}, got {self.kv_cache_layout!r}")
        require(self.page_size >= 1, "page_size", f"must be >= 1, got {self.page_size}")
        require(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
              "max_total_tokens", f"must hold at least one page ({self.page_size}), got {self.max_total_tokens}")
        require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
              f"must be >= 1, got {self.max_num_batched_tokens}")
        require(self.max_itl_ms is None or 0 < self.max_itl_ms < float("inf"), "max_itl_ms",
                f"must be a finite number of milliseconds > 0, got {self.max_itl_ms}")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.cuda_graph_sizes is None or all(size >= 1 for size in self.cuda_graph_sizes),
                "cuda_graph_sizes", f"must be positive batch sizes, got {self.cuda_graph_sizes}")
        require(self.mixed_step_graph_sizes is None or all(size >= 1 for size in self.mixed_step_graph_sizes),
                "mixed_step_graph_sizes", f"must be positive token counts, got {self.mixed_step_graph_sizes}")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
              f"must be >= 1, got {self.max_model_len}")
        require(self.host_cache_size >= 0, "host_cache_size", f"must be >= 0 GB, got {self.host_cache_size}")
        require(self.disk_cache_size > 0, "disk_cache_size", f"must be > 0 GB, got {self.disk_cache_size}")
        require(self.host_cache_write_policy in HOST_CACHE_WRITE_POLICIES, "host_cache_write_policy",
                f"must be one of {HOST_CACHE_WRITE_POLICIES}, got {self.host_cache_write_policy!r}")
        require(not self.decode_offload or bool(self.disk_cache_dir), "decode_offload",
                "needs the shared store: set disk_cache_dir (the directory the prefill servers name too)")
        require(not self.decode_offload or self.host_cache_write_policy == "write_through", "decode_offload",
                f"writes pages as they fill: needs host_cache_write_policy 'write_through', "
                f"got {self.host_cache_write_policy!r}")
        require(not self.decode_offload or self.enable_prefix_caching, "decode_offload",
                "pages reach the store through the prefix cache: needs enable_prefix_caching")
        require(not self.decode_offload or self.transfer is None or self.transfer.role == "decode",
                "decode_offload", "applies to decode servers (--role decode) and colocated engines, "
                                  "not to a prefill server")
        require(self.preemption_mode is None or self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        require(self.preemption_mode != "swap" or self.has_host_tier, "preemption_mode",
                "swap needs a host tier: set host_cache_size (or disk_cache_dir)")

        require(self.structured_outputs_compile_timeout > 0, "structured_outputs_compile_timeout",
                f"must be > 0 seconds, got {self.structured_outputs_compile_timeout}")
        self._validate_speculation()
        self._validate_tensor_parallel()

    @property
    def has_host_tier(self) -> bool:
        return self.host_cache_size > 0 or bool(self.disk_cache_dir)

    @property
    def resolved_kv_cache_layout(self) -> str:
        """``kv_cache_layout`` with "auto" decided: page-major on a PD server, else layer-major."""
        if self.kv_cache_layout != "auto":
            return self.kv_cache_layout
        return "page-major" if self.transfer is not None else "layer-major"

    @property
    def resolved_preemption_mode(self) -> str:
        if self.preemption_mode is not None:
            return self.preemption_mode
        return "swap" if self.has_host_tier else "recompute"

    def _validate_speculation(self) -> None:
        if self.speculative_method is None and self.speculative_model is not None:
            object.__setattr__(self, "speculative_method", "draft")
        method = self.speculative_method
        require(method is None or method in SPECULATIVE_METHOD_CHOICES, "speculative_method",
                f"must be one of {SPECULATIVE_METHOD_CHOICES}, got {method!r}")
        require(method != "draft" or self.speculative_model is not None, "speculative_model",
                "a draft model directory is required with speculative_method='draft'")
        require(method != "mtp" or self.speculative_model is None, "speculative_model",
                "not used with speculative_method='mtp' (the next-n layers come with the model)")
        tokens = self.num_speculative_tokens
        require(tokens is None or method is not None, "num_speculative_tokens",
                "needs speculative_method (or speculative_model)")
        require(tokens is None or (isinstance(tokens, int) and 1 <= tokens <= MAX_SPECULATIVE_TOKENS),
                "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {tokens!r}")
        require(method != "draft" or tokens is not None, "num_speculative_tokens",
                "required with speculative_method='draft'")

    def _validate_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        require(isinstance(size, int) and not isinstance(size, bool) and size >= 1, "tensor_parallel_size",
                f"must be an integer >= 1, got {size!r}")
        backend = self.distributed_executor_backend
        require(backend in DISTRIBUTED_EXECUTOR_BACKENDS, "distributed_executor_backend",
                f"must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, got {backend!r}")
        require(self.ray_placement_strategy in RAY_PLACEMENT_STRATEGIES, "ray_placement_strategy",
                f"must be one of {RAY_PLACEMENT_STRATEGIES}, got {self.ray_placement_strategy!r}")
        require(self.ray_placement_strategy == "pack" or backend == "ray", "ray_placement_strategy",
                f"places Ray actors: needs distributed_executor_backend 'ray', got {backend!r}")
        require(backend != "ray" or size == 1 or importlib.util.find_spec("ray") is not None,
                "distributed_executor_backend", RAY_MISSING)
        require(backend != "ray" or size == 1 or ":" not in self.device, "device",
                f"Ray assigns every rank's GPU with distributed_executor_backend 'ray': name the device type "
                f"only, got {self.device!r}")

    @property
    def sanitizer_on(self) -> bool:
        return sanitize_enabled() if self.sanitize is None else self.sanitize

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown names with a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def with_changes(self, **changes) -> "EngineConfig":
        return replace(self, **changes)
