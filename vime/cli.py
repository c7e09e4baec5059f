"""The ``vime`` command: ``vime plot RUN_DIR [--out PNG]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vime`` console script."""
    parser = argparse.ArgumentParser(prog="vime", description="vime: RL post-training for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="Plot a run's metrics.jsonl (reward, logprob diff) to a PNG.")
    plot.add_argument("run_dir", help="Run directory holding metrics.jsonl (the --log-dir of the run).")
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png).")
    args = parser.parse_args(argv)

    if args.command == "plot":
        from vime.utils.plot import plot_run

        try:
            out = plot_run(args.run_dir, args.out)
        except (FileNotFoundError, ValueError) as e:
            print(f"vime plot: {e}", file=sys.stderr)
            return 1
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
