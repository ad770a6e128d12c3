"""The flags of ``tandem serve`` and ``tandem generate`` and how they become an ``EngineConfig``
(and a PD transfer config, and tool-calling options): shared by the ``tandem`` command
(``cli.py``) and ``tandem deploy``, which passes a replica's flags on to its ``tandem serve``.

Flags are named like vLLM's where vLLM has the flag; engine flags map one-to-one onto
``EngineConfig`` fields.
"""
from __future__ import annotations

import argparse
import logging

from tandem.config import (DISTRIBUTED_EXECUTOR_BACKENDS, DTYPE_CHOICES, HOST_CACHE_WRITE_POLICIES, INDEXER_CACHE_DTYPE_CHOICES,
                           KV_CACHE_DTYPE_CHOICES, KV_CACHE_LAYOUT_CHOICES, LOAD_FORMAT_CHOICES, PREEMPTION_MODES,
                           QUANTIZATION_CHOICES, QUANTIZED_COMPUTE_CHOICES, RAY_PLACEMENT_STRATEGIES,
                           SPECULATIVE_METHOD_CHOICES, EngineConfig)
from tandem.entrypoints.model_choice import DEMO_MODEL_NAME

DEFAULT_CORE_CLASS = "tandem.engine.core:EngineCore"  # (the engine process's; a test may name another)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that configure the engine (``EngineConfig``), shared by ``serve`` and ``generate``."""
    group = parser.add_argument_group("model and engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face model directory (config.json, safetensors, tokenizer files). "
                            "Default (or 'demo'): the built-in tiny demo model, built once into $TANDEM_CACHE_DIR "
                            "(default ~/.cache/tandem).")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="weight and activation dtype; auto: the checkpoint's (default: %(default)s)")
    group.add_argument("--load-format", choices=LOAD_FORMAT_CHOICES, default="auto",
                       help="how to load weights; dummy: random weights of the same architecture "
                            "(default: %(default)s)")
    group.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                       help="fp8: quantize a bf16/fp32 checkpoint's linear weights to FP8 per output channel "
                            "at load. FP8 checkpoints (block-scaled, per-tensor, compressed-tensors) load as "
                            "FP8 without it (default: none)")
    group.add_argument("--quantized-compute", choices=QUANTIZED_COMPUTE_CHOICES, default="auto",
                       help="quantized weights: fp8 (FP8 products, activations quantized on the fly) or "
                            "dequantized (weights dequantized at load); auto: fp8 on CUDA, dequantized on a "
                            "CPU (default: %(default)s)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    group.add_argument("--seed", type=int, default=0, help="engine random seed (default: %(default)s)")
    group.add_argument("--page-size", type=int, default=16,
                       help="tokens per KV-cache page (vLLM: --block-size) (default: %(default)s)")
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help="size of the KV-cache pool in tokens (default: from the memory budget)")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="memory for all KV-cache state buffers, in bytes (default: from the device)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="on CUDA, fraction of device memory tandem may use (default: %(default)s)")
    group.add_argument("--max-num-seqs", type=int, default=256,
                       help="most sequences running at once (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="most tokens computed in one step (default: %(default)s)")
    group.add_argument("--max-itl-ms", type=positive_milliseconds, default=None, metavar="MS",
                       help="inter-token gap target for running decodes: a step with running decodes takes only "
                            "as many prefill tokens as keep its predicted time (learnt online from step times) "
                            "within MS milliseconds, at least one page; prefill takes what is left (default: "
                            "off: prefill takes the whole --max-num-batched-tokens)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus output, in tokens (default: the model's context length)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of shared prompt prefixes (default: on)")
    group.add_argument("--indexer-cache-dtype", choices=INDEXER_CACHE_DTYPE_CHOICES, default="fp8",
                       help="sparse-attention (DSA) indexer key cache: fp8 (e4m3 keys + fp32 scales, "
                            "page-major) or float32 (unquantised) (default: %(default)s)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                       help="paged K/V cache of attention layers: auto (the model dtype) or fp8/fp8_e4m3 "
                            "(float8 e4m3, scale 1.0, saturated at +-448: lossy, twice the tokens per byte; "
                            "MLA latents, indexer keys and recurrent state keep their dtype) (default: %(default)s)")
    group.add_argument("--kv-cache-layout", choices=KV_CACHE_LAYOUT_CHOICES, default="auto",
                       help="device state pools: layer-major (one tensor per layer and buffer) or page-major "
                            "(a page of every layer of a state group is one block of memory, so a prompt's "
                            "pages move in one write per run of pages); auto: page-major with --role "
                            "prefill/decode, layer-major otherwise (default: %(default)s)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: run every step eagerly (CUDA only; default: decode steps "
                            "replay graphs captured at start-up)")
    group.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                       help="decode batch sizes to capture CUDA graphs for (default: 1 2 4 8, then every 16 "
                            "up to 256 and every 32 up to 512, capped at --max-num-seqs)")
    group.add_argument("--mixed-step-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="CUDA graphs for steps with a prompt chunk, their attention layers run eagerly "
                            "between them (attention-only models; under tensor parallelism on every rank)")
    group.add_argument("--mixed-step-graph-sizes", type=int, nargs="+", default=None,
                       help="token counts to capture mixed-step graphs for (default: 8 16 32 48 64 96 128 160 "
                            "192 256 320 384 448 512 640 768 896 1024, under tensor parallelism also 1536 2048 3072 "
                            "4096; capped at --max-num-batched-tokens)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="overlap the host's scheduling of step N+1 with the device's step N "
                            "(default: on for CUDA devices)")
    group.add_argument("--speculative-method", choices=SPECULATIVE_METHOD_CHOICES, default=None,
                       help="speculative decoding: mtp (the checkpoint's next-n layers; DeepSeek-V3, V3.2, "
                            "GLM-5) or draft (--speculative-model) (default: off)")
    group.add_argument("--num-speculative-tokens", type=int, default=None,
                       help="draft tokens verified per step (default for mtp: the number of next-n layers)")
    group.add_argument("--speculative-model", default=None,
                       help="draft model directory (same vocabulary as --model); implies --speculative-method draft")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard the model over this many ranks, one engine process each (rank i on "
                            "cuda:i; on a CPU over gloo) (default: %(default)s)")
    group.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="tensor parallelism on CUDA: NCCL for every all-reduce (default: messages up to "
                            "a few MiB go through peer buffers, one-shot or two-shot by size, see "
                            "docs/allreduce.md)")
    group.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS, default="mp",
                       help="how ranks 1..N-1 of --tensor-parallel-size run: mp, processes of this host; ray, "
                            "actors on the Ray cluster at RAY_ADDRESS (a local one when unset), across nodes "
                            "(pip install \"tandem[ray]\"); rank 0 stays in the engine process (default: %(default)s)")
    group.add_argument("--ray-placement-strategy", choices=RAY_PLACEMENT_STRATEGIES, default="pack",
                       help="with --distributed-executor-backend ray: how the placement group of one bundle per "
                            "rank is placed (Ray's PACK, SPREAD, STRICT_PACK, STRICT_SPREAD); rank 0's bundle is "
                            "always on this node (default: %(default)s)")
    group.add_argument("--structured-outputs-compile-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a request whose grammar (response_format, structured_outputs) has not compiled "
                            "within this many seconds is rejected with 400 (default: %(default)s)")
    tiers = parser.add_argument_group("state tiers (host memory and disk behind the prefix cache)")
    tiers.add_argument("--host-cache-size", type=float, default=0.0, metavar="GB",
                       help="host-memory tier in GB (2^30 bytes; pinned on CUDA); 0: off (default: %(default)s)")
    tiers.add_argument("--host-cache-write-policy", choices=HOST_CACHE_WRITE_POLICIES, default="write_through",
                       help="when device pages are copied to the host tier: as they are cached "
                            "(write_through), on their second hit (write_through_selective), or when "
                            "they leave the device (write_back) (default: %(default)s)")
    tiers.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                       help="disk tier directory (survives restarts; engines naming the same directory "
                            "share it); with no --host-cache-size, the host tier gets as many pages as "
                            "the device pool (default: off)")
    tiers.add_argument("--disk-cache-size", type=float, default=16.0, metavar="GB",
                       help="disk tier size cap in GB, least recently used pages go first (default: %(default)s)")
    tiers.add_argument("--decode-offload", action="store_true", default=False,
                       help="on a decode server: copy each page that fills while decoding to the host tier and "
                            "on to --disk-cache-dir (the store the prefill servers share), so the next turn of "
                            "a conversation hits it on any prefill server (needs --disk-cache-dir)")
    tiers.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=None,
                       help="swap: a preempted request's state goes to the host tier and comes back; "
                            "recompute: it is recomputed (default: swap with a host tier, else recompute; "
                            "recompute also when the host tier is full)")


def positive_milliseconds(text: str) -> float:
    """A duration flag in milliseconds: a number > 0 (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of milliseconds > 0, got {text}")
    return value


def engine_config(arguments: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig(
        model=model, tokenizer=arguments.tokenizer, dtype=arguments.dtype, load_format=arguments.load_format,
        quantization=arguments.quantization, quantized_compute=arguments.quantized_compute, device=arguments.device, seed=arguments.seed, page_size=arguments.page_size,
        max_total_tokens=arguments.max_total_tokens, kv_cache_memory_bytes=arguments.kv_cache_memory_bytes,
        gpu_memory_utilization=arguments.gpu_memory_utilization, enable_prefix_caching=arguments.enable_prefix_caching,
        max_num_seqs=arguments.max_num_seqs, max_num_batched_tokens=arguments.max_num_batched_tokens,
        max_itl_ms=arguments.max_itl_ms,
        max_model_len=arguments.max_model_len, indexer_cache_dtype=arguments.indexer_cache_dtype,
        kv_cache_dtype=arguments.kv_cache_dtype, kv_cache_layout=arguments.kv_cache_layout,
        enforce_eager=arguments.enforce_eager, async_scheduling=arguments.async_scheduling,
        cuda_graph_sizes=tuple(arguments.cuda_graph_sizes) if arguments.cuda_graph_sizes else None,
        mixed_step_graphs=arguments.mixed_step_graphs,
        mixed_step_graph_sizes=tuple(arguments.mixed_step_graph_sizes) if arguments.mixed_step_graph_sizes else None,
        host_cache_size=arguments.host_cache_size, host_cache_write_policy=arguments.host_cache_write_policy,
        disk_cache_dir=arguments.disk_cache_dir, disk_cache_size=arguments.disk_cache_size,
        decode_offload=arguments.decode_offload, preemption_mode=arguments.preemption_mode,
        speculative_method=arguments.speculative_method, num_speculative_tokens=arguments.num_speculative_tokens,
        speculative_model=arguments.speculative_model, tensor_parallel_size=arguments.tensor_parallel_size,
        disable_custom_all_reduce=arguments.disable_custom_all_reduce,
        distributed_executor_backend=arguments.distributed_executor_backend,
        ray_placement_strategy=arguments.ray_placement_strategy,
        structured_outputs_compile_timeout=arguments.structured_outputs_compile_timeout)


def resolve_model(arguments: argparse.Namespace) -> tuple[str, bool]:
    """The model directory to use, and whether it is the built-in demo model (built on first use)."""
    from tandem.entrypoints.model_choice import resolve_model as resolve_model_path

    try:
        return resolve_model_path(arguments.model)
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``tandem serve`` (``tandem deploy`` passes them on to its replicas)."""
    add_engine_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0: every interface (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 and tokenizer routes "
                            "(default: $TANDEM_API_KEY; none: open)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients may ask for (default: the --model argument, or "
                            f"'{DEMO_MODEL_NAME}' for the demo model)")
    group.add_argument("--max-queued-requests", type=int, default=4096,
                       help="requests allowed to wait beyond --max-num-seqs; more get 503 with Retry-After (default: %(default)s)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may take to finish after SIGINT/SIGTERM (default: %(default)s)")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error", "critical"], default="info",
                       help="log level of the server and the engine (default: %(default)s)")
    group.add_argument("--engine-core-class", default=DEFAULT_CORE_CLASS, help=argparse.SUPPRESS)
    add_tool_calling_arguments(parser)
    add_transfer_arguments(parser)


def add_tool_calling_arguments(parser: argparse.ArgumentParser) -> None:
    """Chat flags for agents (vLLM's names): tool calls in the model's own format, and thinking."""
    from tandem.entrypoints.openai.reasoning import REASONING_PARSERS
    from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("tool calling and reasoning")
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                       help='let the model decide when to call tools (tool_choice "auto", the default with tools); '
                            "needs --tool-call-parser")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the model's tool-call format: hermes (Qwen2.5, Qwen3, Hermes), llama3_json "
                            "(Llama 3.x), deepseek_v3 (DeepSeek-V3, R1-0528), glm45 (GLM-4.5, GLM-4.6)")
    group.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="put the model's thinking (<think>...</think>) in reasoning_content")


def tool_calling_options(arguments: argparse.Namespace):
    from tandem.entrypoints.openai.tool_choice import ToolCallingOptions

    if arguments.enable_auto_tool_choice and arguments.tool_call_parser is None:
        raise SystemExit("tandem serve: --enable-auto-tool-choice needs --tool-call-parser")
    return ToolCallingOptions(enable_auto_tool_choice=arguments.enable_auto_tool_choice,
                              tool_call_parser=arguments.tool_call_parser,
                              reasoning_parser=arguments.reasoning_parser)


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation flags of ``serve`` (defaults: tandem/transfer/config.py)."""
    from tandem.transfer.config import BACKEND_CHOICES, ROLE_CHOICES

    group = parser.add_argument_group("prefill/decode disaggregation")
    group.add_argument("--role", choices=ROLE_CHOICES, default="colocated",
                       help="colocated: prefill and decode here; prefill or decode: one leg of a PD pair, "
                            "behind 'tandem router' (default: %(default)s)")
    group.add_argument("--transfer-backend", choices=BACKEND_CHOICES, default="nixl",
                       help="how state moves between prefill and decode (default: %(default)s)")
    group.add_argument("--pd-address", default="tcp://127.0.0.1:0",
                       help="the engine's control (bootstrap) address, tcp://HOST:PORT; port 0: any free port; "
                            "the router reads it from GET /pd/info (default: %(default)s)")
    group.add_argument("--pd-heartbeat-interval", type=float, default=1.0,
                       help="seconds between heartbeats to each peer (default: %(default)s)")
    group.add_argument("--pd-peer-timeout", type=float, default=10.0,
                       help="seconds of silence after which a peer is dead: its transfers fail and their "
                            "destination pages are released (default: %(default)s)")
    group.add_argument("--pd-connect-timeout", type=float, default=10.0,
                       help="decode: seconds a prefill server may take to answer the handshake (default: %(default)s)")
    group.add_argument("--pd-bootstrap-timeout", type=float, default=300.0,
                       help="seconds a request may wait for its destination pages / its admission on the decode "
                            "server (default: %(default)s)")
    group.add_argument("--pd-transfer-timeout", type=float, default=120.0,
                       help="seconds from destination pages to commit (default: %(default)s)")
    group.add_argument("--pd-progress-thread", action=argparse.BooleanOptionalAction, default=False,
                       help="run the transfer backend's progress thread (it keeps a core busy); needed only "
                            "where writes are not one-sided, e.g. UCX over TCP between hosts (default: off)")
    group.add_argument("--pd-secret-file", default=None, metavar="PATH",
                       help="file holding the deployment secret that authenticates every PD control message "
                            "(the same on every prefill and decode server; at least 16 bytes). Default: "
                            "$TANDEM_PD_SECRET; else, when --pd-address is loopback, this user's generated "
                            "$TANDEM_CACHE_DIR/pd_secret; required for any other address")
    group.add_argument("--pd-drain-timeout", type=float, default=10.0,
                       help="prefill: seconds a failed transfer's writes may take to finish before they are "
                            "cancelled (default: %(default)s)")


def transfer_config(arguments: argparse.Namespace):
    """The ``TransferConfig`` of a prefill or decode server (None when colocated)."""
    if arguments.role == "colocated":
        return None
    from tandem.transfer.config import TransferConfig

    try:
        return TransferConfig(role=arguments.role, backend=arguments.transfer_backend,
                              bootstrap_address=arguments.pd_address,
                              heartbeat_interval=arguments.pd_heartbeat_interval,
                              peer_timeout=arguments.pd_peer_timeout, connect_timeout=arguments.pd_connect_timeout,
                              bootstrap_timeout=arguments.pd_bootstrap_timeout,
                              transfer_timeout=arguments.pd_transfer_timeout,
                              drain_timeout=arguments.pd_drain_timeout,
                              progress_thread=arguments.pd_progress_thread,
                              secret_file=arguments.pd_secret_file).with_secret()
    except ValueError as error:
        raise SystemExit(f"tandem serve: {error}") from None


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
