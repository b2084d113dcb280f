"""`moerun inspect PATH`: what a checkpoint holds (architecture, formats, memory), as text or JSON."""

from __future__ import annotations

import argparse
import json


def add_parser(commands) -> None:
    inspect = commands.add_parser("inspect", help="what a checkpoint holds: architecture, formats, memory")
    inspect.add_argument(
        "path", help="a HF checkpoint directory, a .gguf file, or a hub id in the local cache"
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moerun.checkpoint.describe import describe, format_description

    description = describe(args.path)
    print(json.dumps(description) if args.json else format_description(description))
    return 0
