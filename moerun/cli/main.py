"""The `moerun` command line: one module per subcommand, each adding its parser."""

from __future__ import annotations

import argparse
import sys

from moerun.cli import bench, chat, generate, inspect, quantize

SUBCOMMANDS = (bench, generate, chat, inspect, quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moerun", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:  # bad input: files, settings, prompts (one sentence each)
        print(f"moerun {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
