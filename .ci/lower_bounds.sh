#!/usr/bin/env bash
# The lowest versions pyproject.toml accepts, tested: a clean venv with torch first (the local CPU
# build, as in the Makefile), then transformers, accelerate, peft and trl at the lower bounds read from
# pyproject.toml, the package itself with --no-deps, `pip check` (the declared ranges accept what was
# installed), and a fast subset of the tests (~2 min): Trainer parity of every family and of the
# plugins= entry point, TRL's fused LM head and SFTTrainer, the command line. Fails if a test is
# skipped: a skip would hide a missing package. torch's lower bound (2.11) is not tested here (only
# torch 2.13 installs on the CPU machines; the GPU machine runs 2.11).
#
# Triton: trl 1.15's fused LM head always calls TRL's Triton kernel (trl 1.16 falls back to torch
# without Triton), so trl 1.15 is tested with Triton installed and TRITON_INTERPRET=1, which runs
# Triton kernels on CPU tensors. Without Triton, trl 1.15's own fused head fails on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TORCH=${TORCH:-torch==2.13.0}
TRITON=${TRITON:-triton==3.9.0}
started=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv="$work/venv"
"$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" "$TORCH"
mapfile -t pins < <("$venv/bin/python" - <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = project["dependencies"] + project["optional-dependencies"]["test"]
wanted = ("transformers", "accelerate", "peft", "trl")
found = {}
for requirement in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*(,.*)?", requirement)
    if match and match.group(1).lower() in wanted:
        found[match.group(1).lower()] = match.group(2)
missing = [name for name in wanted if name not in found]
if missing:
    raise SystemExit(f"pyproject.toml declares no `>=` lower bound for {missing}")
for name in wanted:
    print(f"{name}=={found[name]}")
EOF
)
echo "lower bounds: ${pins[*]} ($TORCH)"
"${pip[@]}" "${pins[@]}" "pytest>=8" "$TRITON"
"${pip[@]}" --no-deps -e .
"$venv/bin/python" -m pip check
"$venv/bin/python" - "${pins[@]}" <<'EOF'
import sys
from importlib import metadata

from packaging.version import Version

for pin in sys.argv[1:]:
    name, version = pin.split("==")
    installed = metadata.version(name)
    assert Version(installed) == Version(version), f"{name} {installed} installed, {version} wanted"
EOF
log="$work/pytest.log"
HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=1 \
    "$venv/bin/python" -m pytest -q -rs -m "not gpu" -p no:cacheprovider \
    tests/parity/test_parity.py::test_trainer_parity_fp32 tests/parity/test_parity.py::test_plugins_kwarg_and_stock_optimizer \
    tests/integration/trl/test_trl_fused_head.py tests/parity/test_layer_major.py::test_trl_sft_trainer_layer_major \
    tests/parity/test_layer_major.py::test_trl_fused_lm_head_runs_in_the_head_unit tests/integration/cli/test_cli.py 2>&1 | tee "$log"
if grep -Eq "[0-9]+ skipped" "$log"; then
    echo "lower bounds: tests were skipped (see above); a skip here means a package is missing" >&2
    exit 1
fi
echo "lower bounds: done in $(( $(date +%s) - started )) s"
