"""Serve any milestone over an OpenAI-compatible HTTP API.

    python -m milestones.serve --milestone m4 [--model PATH] [--host 127.0.0.1] [--port 8000]
    make serve M=m4

The command line: it loads the milestone's ``LLM`` with the engine options given, bounds
each request by the limits given (``Limits``), and serves the app of ``milestones.server``
with uvicorn. Bad input gets a 400 with the engine's own message and never reaches a step;
a server with ``--max-requests`` sequences in flight answers 503 with ``Retry-After`` (a
request's ``n`` samples count ``n``); a client that disconnects mid-stream has its request
aborted and its KV blocks freed before the next step; ``--api-key`` closes the ``/v1``
routes to callers without it.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import json
import logging
import os
from typing import Any

from milestones import MILESTONES
from milestones.server.app import create_app
from milestones.server.limits import Limits
from milestones.server.listen import graceful_server, header_deadline

logger = logging.getLogger(__name__)


# milestones.kernels.QUANTIZATIONS, written out so that the command line loads without torch (a test checks them)
QUANTIZATIONS = ("gguf", "int8")
# milestones.m9.config.ROUTER_POLICIES, written out for the same reason (a test checks them too)
ROUTER_POLICIES = ("cache_aware", "round_robin")


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m milestones.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--milestone", choices=MILESTONES, default="m4")
    parser.add_argument("--model", help="a checkpoint folder or hub id (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the name clients use (default: the model's folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    default = Limits()
    parser.add_argument("--max-requests", type=int, default=default.max_requests,
                        help="sequences in flight (a request's n samples count n) before 503")
    parser.add_argument("--max-n", type=int, default=default.max_n, help="samples of one prompt a request may ask")
    parser.add_argument("--max-body-bytes", type=int, default=default.max_body_bytes, help="the largest request body")
    parser.add_argument("--body-timeout", type=float, default=default.body_timeout,
                        help="seconds a request body may stall before 408")
    parser.add_argument("--header-timeout", type=float, default=default.header_timeout,
                        help="seconds a connection may take to send a request's line and headers before 408")
    parser.add_argument("--api-key", default=os.environ.get("MILESTONES_API_KEY"),
                        help="the key the /v1 routes want, as 'Authorization: Bearer KEY' (default: "
                             "$MILESTONES_API_KEY)")
    parser.add_argument("--shutdown-grace", type=float, default=30,
                        help="seconds open streams get to finish at shutdown before they are aborted")
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineConfig option, e.g. max_num_seqs=16 (repeatable; values are JSON or text)")
    parser.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                        help='m7: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (vLLM\'s flag)')
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="m8: split the model over N ranks, each a process holding a shard of every layer "
                             "(vLLM's flag); N must divide the model's attention heads and MLP width")
    parser.add_argument("--num-prefill-workers", type=int, default=0, metavar="N",
                        help="m9: compute prompts on N prefill workers, each a process (SGLang's "
                             "--disaggregation-mode prefill); with --num-decode-workers, both at least 1")
    parser.add_argument("--num-decode-workers", type=int, default=0, metavar="N",
                        help="m9: decode on N decode workers, each a process that takes a prompt's keys and values "
                             "from its prefill worker; 0 and 0: one engine")
    parser.add_argument("--router-policy", choices=ROUTER_POLICIES, default=None,
                        help="m9: which prefill worker a request goes to: where most of its prompt went before "
                             "(cache_aware, the engine's default) or in turn (round_robin)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="keep the weights quantized: gguf, the bundled file's 4-bit blocks; int8, made at load "
                             "(CPU, float32)")
    return parser


# The options that are a later milestone's lesson: the first milestone that takes each, and what it teaches
LATER_OPTIONS = {"speculative_config": ("m7", "speculative decoding"),
                 "tensor_parallel_size": ("m8", "tensor parallelism"),
                 "num_prefill_workers": ("m9", "prefill/decode disaggregation"),
                 "num_decode_workers": ("m9", "prefill/decode disaggregation"),
                 "router_policy": ("m9", "prefill/decode disaggregation")}


def engine_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, object]:
    """The engine's options from the command line. A flag the milestone does not take (--tensor-parallel-size 2 with
    m7) is refused as a command-line error, before anything loads."""
    options = dict(_engine_option(text) for text in args.engine_option)
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    for flag in ("num_prefill_workers", "num_decode_workers"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.speculative_config is not None:
        options["speculative_config"] = args.speculative_config
    if args.tensor_parallel_size > 1:  # 1 is every milestone's way: one process, the whole model
        options["tensor_parallel_size"] = args.tensor_parallel_size
    for flag in ("num_prefill_workers", "num_decode_workers"):  # 0: every milestone's way, one engine
        if getattr(args, flag):
            options[flag] = getattr(args, flag)
    if args.router_policy is not None:  # None: m9's own default (it routes only with workers)
        options["router_policy"] = args.router_policy
    if args.quantization is not None:  # None: every milestone's way, the weights in the engine's dtype
        options["quantization"] = args.quantization
    for name, (first, lesson) in LATER_OPTIONS.items():
        if name in options and MILESTONES.index(args.milestone) < MILESTONES.index(first):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} needs --milestone {first} or later ({lesson} is {first}'s lesson); "
                         f"{args.milestone} has no {name}")
    return options


def load_llm(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The milestone's LLM with the command line's options; an option the engine refuses (a tensor-parallel size
    that does not divide the model's heads, say) is a command-line error with the engine's message."""
    options = engine_options(parser, args)
    try:
        return importlib.import_module(f"milestones.{args.milestone}").LLM(args.model, **options)
    except ValueError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = command_line()
    args = parser.parse_args(argv)
    llm = load_llm(parser, args)  # m8 with --tensor-parallel-size N: rank 0 here, and N - 1 worker processes;
    # m9 with prefill and decode workers: the router here, and a process per worker
    name = args.served_model_name or _default_name(args.model)
    if args.api_key is None and not _is_loopback(args.host):
        logger.warning("serving on %s with no --api-key: anyone who reaches this address can use the model", args.host)
    limits = limits_from(args)
    config = uvicorn.Config(create_app(llm, name, limits=limits, api_key=args.api_key), host=args.host, port=args.port,
                            timeout_graceful_shutdown=args.shutdown_grace, http=header_deadline(limits.header_timeout))
    graceful_server(config).run()


def limits_from(args: argparse.Namespace) -> Limits:
    """The command line's limits (the others keep Limits' defaults)."""
    return Limits(max_requests=args.max_requests, max_n=args.max_n, max_body_bytes=args.max_body_bytes,
                  body_timeout=args.body_timeout, header_timeout=args.header_timeout)


def _is_loopback(host: str) -> bool:
    """127.0.0.1, ::1 and localhost reach this machine only; anything else (0.0.0.0 included) may reach others."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _engine_option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-option takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _default_name(model: str | None) -> str:
    return "SmolLM2-135M-Instruct" if model is None else model.rstrip("/").rsplit("/", 1)[-1]


if __name__ == "__main__":
    main()
