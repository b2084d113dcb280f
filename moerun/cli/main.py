"""The `moerun` command line: one module per subcommand, each adding its parser."""

from __future__ import annotations

import argparse
import sys

import moerun
from moerun.cli import bench, chat, generate, inspect, perplexity, quantize, serve
from moerun.cli.common import INTERRUPTED, HelpFormatter

SUBCOMMANDS = (bench, generate, chat, serve, perplexity, inspect, quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moerun", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"moerun {moerun.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands)
    for command in commands.choices.values():
        command.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:  # bad input: files, settings, prompts (one sentence each)
        print(f"moerun {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nmoerun {args.command}: interrupted.", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
