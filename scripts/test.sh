#!/usr/bin/env bash
# Sets up .venv and runs lint plus the test suite; what CI runs. Slow tests: pass `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check moerun tests
echo "lines of code: moerun $(find moerun -name '*.py' -exec cat {} + | wc -l), tests $(cat tests/*.py | wc -l)"
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
.venv/bin/python -m pytest -q "$@"
