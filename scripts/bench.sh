#!/usr/bin/env bash
# Sets up .venv and runs the main job: `moerun bench` on its default workload (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh bench
.venv/bin/moerun bench "$@"
