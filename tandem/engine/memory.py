"""Where the engine runs and how much memory its state pools may take."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

from tandem.config import EngineConfig
from tandem.kv.planner import bytes_per_page, sequence_pools
from tandem.kv.registry import StateRegistry


def resolve_device(name: str) -> torch.device:
    """The engine's device; a CUDA device is made the current one, so that kernels, CUDA graphs
    and side streams land on it (``--device cuda:1``) rather than on device 0."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def on_engine_device(method):
    """Run an engine method with the engine's CUDA device current (``self.device``): a process
    may hold engines on several GPUs (a PD pair stepped by one thread, two models side by side),
    and the Triton kernels, CUDA graphs and side streams an engine launches go to the current
    device. Nothing changes on a CPU."""
    @functools.wraps(method)
    def on_device(self, *arguments, **options):
        scope = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with scope:
            return method(self, *arguments, **options)
    return on_device


def available_host_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


def state_memory_budget(config: EngineConfig, device: torch.device, registry: StateRegistry,
                        max_model_len: int, speculating: bool) -> Optional[int]:
    """Bytes for every state buffer: None when the pool is sized in tokens; the explicit
    budget; on CUDA what ``gpu_memory_utilization`` leaves; on a CPU a fraction of the free
    host memory, capped at what ``max_num_seqs`` sequences of ``max_model_len`` need."""
    if config.max_total_tokens is not None:
        return None
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * config.gpu_memory_utilization) - (total - free)
    layout = config.resolved_kv_cache_layout
    wanted = bytes_per_page(registry, config.page_size, layout) * (
        -(-max_model_len // config.page_size) * config.max_num_seqs + 1)
    wanted += sequence_pools(registry, config.page_size, config.max_num_seqs,
                             config.enable_prefix_caching, speculating, layout)[1]
    return min(int(available_host_memory() * config.cpu_kv_cache_fraction), wanted)
