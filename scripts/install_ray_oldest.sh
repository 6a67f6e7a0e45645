#!/usr/bin/env bash
# Set up a second environment (argument 2, default .venv-ray-oldest) at the lower corner of what pyproject.toml
# admits: Ray at the lower bound of its `ray[default,tune]` range, and NumPy, numba, transformers and peft each at
# its `>=` bound, with zocheck-ray and its test extras, editable. `make test-ray-oldest` runs the cluster subset
# (`-m ray_range`) in it. Argument 3 names another Ray release instead (to try a lower bound).
# torch is install_torch.sh's (the CPU build wherever there is no CUDA device): no older CPU build installs here.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
venv=${2:-.venv-ray-oldest}
ray=${3:-$(sed -n 's/^ *"ray\[default,tune\]>=\([0-9.]*\),.*/\1/p' pyproject.toml)}
[ -n "$ray" ] || { echo "install_ray_oldest: no 'ray[default,tune]>=X,<Y' in pyproject.toml" >&2; exit 1; }
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
bash scripts/install_torch.sh "$venv/bin/python" "$venv/constraints.txt"
# each lower bound as a pin, beside install_torch.sh's CPU torch (its bound is not tested: pyproject.toml)
for name in numpy numba transformers peft; do
  bound=$(sed -n "s/^ *\"$name>=\([0-9.]*\)[,\"].*/\1/p" pyproject.toml)
  [ -n "$bound" ] || { echo "install_ray_oldest: no '\"$name>=X' in pyproject.toml's dependencies" >&2; exit 1; }
  echo "$name==$bound" >> "$venv/constraints.txt"
done
bash scripts/install_package.sh "$venv/bin/python" "$venv/constraints.txt" "$ray"
"$venv/bin/python" - "$venv" "ray==$ray" $(grep -v '^triton' "$venv/constraints.txt") <<'EOF'
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
import torch

venv, *pins = sys.argv[1:]
pins = {r.name: r for r in map(Requirement, pins)}
wrong = [f"{name} {version(name)}, not {r.specifier}" for name, r in pins.items()
         if not r.specifier.contains(version(name), prereleases=True)]
if torch.version.cuda is not None and not torch.cuda.is_available():
    wrong.append("torch is a CUDA build on a machine without CUDA")
if wrong:
    sys.exit(f"install_ray_oldest: {venv} has " + "; ".join(wrong))
print(f"install_ray_oldest: {venv} has " + ", ".join(f"{name} {version(name)}" for name in pins))
EOF
