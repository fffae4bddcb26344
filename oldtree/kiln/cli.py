"""The ``kiln`` command line: compile, fetch, generate, chat, serve, bench.

Expected failures (a bad path, an unsupported architecture, an invalid option) print one line
``kiln: error: ...`` and exit with status 2; only unexpected ones show a traceback.
"""

from __future__ import annotations

import argparse
import sys

from kiln import cli_bench, cli_compile, cli_generate, cli_plan, cli_serve
from kiln.runtime.worker.nccl_env import keep_multicast_off

EXPECTED_ERRORS = (ValueError, FileNotFoundError, FileExistsError, LookupError)


def main(argv: list[str] | None = None) -> int:
    keep_multicast_off()  # before any process or communicator kiln makes: they inherit it
    parser = argparse.ArgumentParser(prog="kiln", description="Compile, serve and benchmark LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    cli_compile.add_parser(commands)
    _add_fetch(commands)
    cli_generate.add_parsers(commands)
    cli_bench.add_parser(commands)
    cli_plan.add_parser(commands)
    cli_serve.add_serve_parser(commands)
    cli_serve.add_router_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except EXPECTED_ERRORS as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _add_fetch(commands) -> None:
    p = commands.add_parser("fetch", help="obtain a model by alias into the cache (KILN_HOME)")
    p.add_argument("alias", help="e.g. smollm2-135m-instruct")
    p.set_defaults(run=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    from kiln.compiler.sources.aliases import fetch

    print(fetch(args.alias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
