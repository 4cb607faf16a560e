#!/usr/bin/env bash
# Run every benchmark and rewrite docs/benchmarks.md. Arguments go to `python -m bench`
# (--quick for a ~2 minute smoke run that writes bench/out/benchmarks.md, --only SECTION,...).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m bench "$@"
