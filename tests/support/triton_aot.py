"""Compile a Triton kernel for an H100 (sm_90) on a machine without a GPU, with Triton's bundled
ptxas, and return its PTX: what the CPU tests read to check how a kernel moves its data.

It runs in a process of its own (``ptx_for_h100``): under ``TRITON_INTERPRET=1``, which the CPU
tests set before any kernel is defined, Triton's own library functions are interpreted ones and
cannot be compiled. Arguments get the 16-byte divisibility the JIT finds in a launch's pointers
and sizes, except those named in ``unaligned``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def compile_request(module: str, kernel: str, signature: dict, constexprs: dict, warps: int, stages: int,
                    unaligned: tuple[str, ...] = ()) -> dict:
    """One kernel to compile: its module and name, argument types (``"*bf16"``, ``"i32"``),
    constexpr values, launch options, and the arguments the JIT would find of unknown alignment."""
    return dict(module=module, kernel=kernel, signature=signature, constexprs=constexprs, warps=warps,
                stages=stages, unaligned=list(unaligned))


def ptx_for_h100(requests: list[dict]) -> list[str]:
    """The PTX of each ``compile_request``, compiled in one process of its own."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    finished = subprocess.run([sys.executable, "-m", "tests.support.triton_aot", json.dumps(requests)], capture_output=True,
                              text=True, env=environment, cwd=Path(__file__).resolve().parents[2], timeout=300)
    if finished.returncode:
        raise RuntimeError(f"compiling for sm_90 failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout)


def _compile(request: dict) -> str:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    function = getattr(importlib.import_module(request["module"]), request["kernel"])
    names = list(request["signature"])
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in names if name not in request["unaligned"]}
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": request["warps"],
                                                                   "num_stages": request["stages"]})
    signature = {**request["signature"], **{name: "constexpr" for name in request["constexprs"]}}
    source = ASTSource(fn=function, signature=signature, constexprs=request["constexprs"], attrs=attrs)
    return triton.compile(source, target=target, options=options.__dict__).asm["ptx"]


if __name__ == "__main__":
    sys.stdout.write(json.dumps([_compile(request) for request in json.loads(sys.argv[1])]))
