"""``critique mcp [--transport stdio|http] [--host H] [--port N] [--fail-open]``: the fleet as an
MCP server (:mod:`workers.adapters.mcp_server`; docs/mcp.md).

``stdio`` (the default) is for an MCP client that starts the server itself (a local MCP config:
``"command": "critique", "args": ["mcp"]``); nothing but the protocol is written to stdout.
``http`` serves streamable HTTP at ``http://HOST:PORT/mcp``, on loopback unless ``--host`` says
otherwise. The process is a client of the fleet at ``REDIS_URL``, signing with its
``CRITIQUE_SECRET``.

Exit codes: 0 when the server stopped (its client went away, or Ctrl-C over HTTP); 2 when the
``mcp`` package is not installed (``pip install -e '.[mcp]'``) or the configuration is refused.
The fleet is not reached at start: each tool call reaches it, and says so when it cannot.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from workers.cli import url_problem
from workers.commands._common import between, number_problem, service_guard
from workers.exit_codes import EXIT_OK, EXIT_USAGE

HELP = "serve the fleet to MCP clients: submit, wait, poll, status and pitfalls as MCP tools"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transport",
        choices=("stdio", "http"),
        default="stdio",
        help="stdio (default: the MCP client starts this command) or streamable http",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="http: the address to listen on (default 127.0.0.1, loopback only)",
    )
    parser.add_argument(
        "--port", type=between(1, 65535), default=8765, help="http: the port (default 8765)"
    )
    parser.add_argument(
        "--fail-open",
        action="store_true",
        help="a wait the fleet cannot answer (unreachable, timed out) returns an `unchecked` "
        "verdict instead of an error (default: an error, never a verdict)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        # lazy: the mcp extra may not be installed; ImportError says which to install
        from workers.adapters.mcp_server import build_server, serve
    except ImportError as exc:
        print(
            f"critique mcp: the mcp package is not installed ({exc}); install it with "
            "pip install -e '.[mcp]' (mcp 2.3.0)",
            file=sys.stderr,
        )
        return EXIT_USAGE

    def body() -> int:
        server = build_server(fail_open=args.fail_open)
        serve(server, args.transport, host=args.host, port=args.port)
        return EXIT_OK

    return service_guard("mcp", body)


def main(argv: Sequence[str] | None = None) -> int:
    """``critique mcp ARGS`` without the ``critique`` dispatcher (tests, ``python -c``); the
    dispatcher's URL check first, as ``critique`` does."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as `critique` does
    parser = argparse.ArgumentParser(prog="critique mcp", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    problem = url_problem() or number_problem(args)
    if problem:
        print(f"critique mcp: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run(args)
    except KeyboardInterrupt:
        return EXIT_OK
