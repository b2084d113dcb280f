"""The `moerun` command line: `main` builds the parser; one module per subcommand."""
