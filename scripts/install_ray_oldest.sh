#!/usr/bin/env bash
# Set up a second environment (argument 2, default .venv-ray-oldest) with the oldest Ray release that
# pyproject.toml admits (the lower bound of its `ray[default,tune]` range), the same torch build as .venv
# (install_torch.sh) and zocheck-ray with its test extras, editable: `make test-ray-oldest` runs the
# cluster subset (`-m ray_range`) in it. Argument 3 names another Ray release instead (to try a lower bound).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
venv=${2:-.venv-ray-oldest}
ray=${3:-$(sed -n 's/^ *"ray\[default,tune\]>=\([0-9.]*\),.*/\1/p' pyproject.toml)}
[ -n "$ray" ] || { echo "install_ray_oldest: no 'ray[default,tune]>=X,<Y' in pyproject.toml" >&2; exit 1; }
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
bash scripts/install_torch.sh "$venv/bin/python" "$venv/constraints.txt"
bash scripts/install_package.sh "$venv/bin/python" "$venv/constraints.txt" "$ray"
"$venv/bin/python" -c "import ray, sys; sys.exit(0 if ray.__version__ == '$ray' else f'{sys.argv[1]} has Ray {ray.__version__}, not $ray')" "$venv"
echo "install_ray_oldest: $venv has Ray $ray"
