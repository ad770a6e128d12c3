"""The ``tandem`` command: ``serve`` (OpenAI-compatible server), ``generate`` (one-off prompts),
``make-model`` (tiny random-weight models for demos and tests), ``router`` (one endpoint in front
of servers) and ``deploy`` (PD replicas on a Ray cluster, ``tandem/entrypoints/deploy``).

Flags are named like vLLM's where vLLM has the flag; engine flags map one-to-one onto
``EngineConfig`` fields. Heavy imports (torch, transformers) happen only inside commands.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from tandem.entrypoints.engine_arguments import (add_engine_arguments, add_serve_arguments, configure_logging,
                                                 engine_config, resolve_model, tool_calling_options, transfer_config)
from tandem.entrypoints.model_choice import DEMO_MODEL_NAME

logger = logging.getLogger("tandem")


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="start an OpenAI-compatible server",
        description="Start an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics, /tokenize, /detokenize): a frontend process and "
                    "an engine process. SIGINT/SIGTERM drain in-flight requests, then exit.")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)


def run_serve(arguments: argparse.Namespace) -> int:
    configure_logging(arguments.log_level)
    tool_calling = tool_calling_options(arguments)
    model, is_demo = resolve_model(arguments)
    from tandem.entrypoints.openai.server import ServerOptions, run_server

    names = arguments.served_model_name or [DEMO_MODEL_NAME if is_demo else arguments.model]
    options = ServerOptions(host=arguments.host, port=arguments.port, api_key=arguments.api_key or os.environ.get("TANDEM_API_KEY") or None,
                            served_model_names=tuple(names), log_level=arguments.log_level,
                            max_queued_requests=arguments.max_queued_requests,
                            shutdown_timeout=arguments.shutdown_timeout,
                            core_class_path=arguments.engine_core_class,
                            tool_calling=tool_calling)
    config = engine_config(arguments, model).with_changes(transfer=transfer_config(arguments))
    return run_server(config, options)


def add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text for prompts given on the command line",
        description="Run the engine in this process on one or more prompts and print the outputs.")
    parser.add_argument("prompts", nargs="+", help="prompt text(s); with --chat each is one user message")
    add_engine_arguments(parser)
    group = parser.add_argument_group("sampling")
    group.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    group.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0: off (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0, help="min-p sampling; 0: off (default: %(default)s)")
    group.add_argument("--n", type=int, default=1, help="outputs per prompt (default: %(default)s)")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (default: none)")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning",
                       help="log level (default: %(default)s)")
    parser.set_defaults(func=run_generate)


def run_generate(arguments: argparse.Namespace) -> int:
    configure_logging(arguments.log_level)
    model, _ = resolve_model(arguments)
    config = engine_config(arguments, model)
    from dataclasses import asdict

    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=arguments.n, temperature=arguments.temperature, top_p=arguments.top_p,
                                top_k=arguments.top_k, min_p=arguments.min_p, seed=arguments.sampling_seed,
                                stop=arguments.stop, ignore_eos=arguments.ignore_eos,
                                max_tokens=arguments.max_tokens)
    except ValueError as error:
        print(f"tandem generate: {error}", file=sys.stderr)
        return 2
    options = {key: value for key, value in asdict(config).items() if key not in ("model", "tokenizer")}
    llm = LLM(model=config.model, tokenizer=config.tokenizer, **options)
    if arguments.chat:
        outputs = llm.chat([[{"role": "user", "content": prompt}] for prompt in arguments.prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(arguments.prompts, params, use_tqdm=False)
    print_outputs(arguments.prompts, outputs)
    return 0


def print_outputs(prompts: Sequence[str], outputs) -> None:
    for prompt, output in zip(prompts, outputs):
        for choice in output.outputs:
            label = f"[{choice.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}{prompt!r} -> {choice.text!r} ({len(choice.token_ids)} tokens, {choice.finish_reason})")


def add_make_model_parser(subparsers) -> None:
    from tandem.tools.make_model import add_cli_parser

    add_cli_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: an LLM serving engine.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_serve_parser(subparsers)
    add_generate_parser(subparsers)
    add_make_model_parser(subparsers)
    from tandem.entrypoints.router import add_router_parser

    add_router_parser(subparsers)
    from tandem.entrypoints.deploy import add_deploy_parser

    add_deploy_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    arguments = build_parser().parse_args(argv)
    return int(arguments.func(arguments) or 0)


if __name__ == "__main__":
    sys.exit(main())
