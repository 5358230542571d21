#!/usr/bin/env bash
# Which trl versions megatrain trains exactly, and that the others are refused naming their version: the TRL
# tests (tests/integration/trl) run once per trl minor version, each version put first on the path of this
# environment (pip install --no-deps --target: trl is pure Python), Triton in interpreter mode for trl 1.15's
# fused head (as .ci/lower_bounds.sh does). A version inside megatrain's range (integrations/trl.py
# SUPPORTED_TRL) must pass; one outside must fail only with megatrain's refusal naming that version.
#
#   bash .ci/trl_versions.sh [VERSION ...]      # default: 1.14.1 (axolotl 0.21's pin) 1.15.0 1.16.0
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TRITON=${TRITON:-triton==3.9.0}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(1.14.1 1.15.0 1.16.0)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip install -q --no-deps --target "$work/triton" "$TRITON"
status=0
for version in "${versions[@]}"; do
    target="$work/trl-$version"
    "$PY" -m pip install -q --no-deps --target "$target" "trl==$version"
    supported=$(PYTHONPATH="$target:$PWD" "$PY" -c "
from megatrain_hf.integrations.trl import SUPPORTED_TRL
parts = tuple(int(p) for p in '$version'.split('.')[:2])
print(int(SUPPORTED_TRL[0] <= parts < SUPPORTED_TRL[1]))")
    log="$work/trl-$version.log"
    started=$(date +%s)
    set +e
    PYTHONPATH="$target:$work/triton:$PWD" TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
        "$PY" -m pytest -q -p no:cacheprovider --junitxml="$work/trl-$version.xml" -m "not gpu" tests/integration/trl \
        --deselect tests/integration/trl/test_trl_versions.py::test_the_installed_trl_is_in_the_range > "$log" 2>&1
    code=$?
    set -e
    summary=$(tail -n 1 "$log")
    # every failure must be megatrain's refusal naming this version (read from pytest's JUnit XML)
    read -r refused other < <("$PY" - "$work/trl-$version.xml" "$version" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

refusal = f"UnsupportedTrlError: megatrain: trl {sys.argv[2]} is outside"
found = [f.get("message", "") + (f.text or "") for case in ET.parse(sys.argv[1]).iter("testcase")
         for f in list(case.iter("failure")) + list(case.iter("error"))]
print(sum(refusal in m for m in found), sum(refusal not in m for m in found))
PYEOF
)
    if [ "$supported" = 1 ] && [ "$code" = 0 ]; then
        verdict="exact (inside the range)"
    elif [ "$supported" = 0 ] && [ "$refused" -gt 0 ] && [ "$other" = 0 ]; then
        verdict="refused, naming trl $version ($refused refusals)"
    else
        verdict="UNEXPECTED (inside the range: $supported)"
        status=1
        tail -n 40 "$log"
    fi
    echo "trl $version: $verdict; pytest: $summary; $(( $(date +%s) - started )) s"
done
exit $status
