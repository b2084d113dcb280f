"""The `moerun` command line: `main` builds the parser; one module per subcommand."""

from moerun.cli.main import main

__all__ = ["main"]
