#!/usr/bin/env bash
# make test-integrations: axolotl, LLaMA-Factory and trl's CLI, each in its own venv with megatrain installed
# from this checkout by plain pip, each tool's full and LoRA fine-tune of a tiny local model through the tool's
# own command, plain vs `python -m megatrain_hf.run` (.ci/integrations/run.py compares every logged loss and
# every saved weight within 1e-6, fp32 on the CPU). WORK (default: a temporary folder) keeps the venvs between
# runs when given; the result table is printed and written to docs/results/integrations.md.
#
# The install lines are the recipes docs/integrations.md gives:
# - trl: pip install megatrain_hf "trl>=1.15,<1.17" datasets
# - LLaMA-Factory 0.9.5 (pins transformers<=5.6, accelerate<=1.11, peft<=0.18.1, all inside megatrain's ranges):
#   pip install megatrain_hf llamafactory==0.9.5. On this machine pip prefers a local CPU build of torch, next to
#   which torchvision's and torchaudio's PyPI wheels cannot load their operators ("torchvision::nms does not
#   exist"; LLaMA-Factory imports both): the venv gets PyPI's torch 2.13.0 instead, as any other machine would.
# - axolotl 0.21 (Python >= 3.12; pins transformers 5.20.1, accelerate 1.15.0, peft 0.21.2, trl 1.14.1):
#   pip install megatrain_hf axolotl==0.21.0 in a 3.12 venv, where pip pulls a CUDA build of torch (it runs on
#   the CPU). trl 1.14 is outside megatrain's range; axolotl's SFT trainer is no TRL trainer, so SFT is not
#   refused (its DPO/KTO/ORPO trainers are, naming the version). axolotl's telemetry is turned off (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PY:-python3}
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python}
TORCH=${TORCH:-torch==2.13.0}
TOOLS=${TOOLS:-trl llamafactory axolotl}
work=${WORK:-$(mktemp -d)}
[ -n "${WORK:-}" ] || trap 'rm -rf "$work"' EXIT
started=$(date +%s)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- megatrain_hf 2>/dev/null || echo '+changes')
mkdir -p "$work"
"$PY" .ci/integrations/fixtures.py "$work"

venv() {  # venv NAME PYTHON PIP-ARGS...: create once, install, then megatrain from this checkout (not editable)
    local dir="$work/venv-$1" python=$2
    shift 2
    if [ ! -x "$dir/bin/python" ]; then
        "$python" -m venv "$dir"
        "$dir/bin/python" -m pip install -q "$@"
    fi
    "$dir/bin/python" -m pip install -q --force-reinstall --no-deps "$root"
    "$dir/bin/python" -m pip check || true
}
for tool in $TOOLS; do
    t0=$(date +%s)
    case $tool in
        trl) venv trl "$PY" "$TORCH" "$root" "trl>=1.15,<1.17" datasets ;;
        llamafactory)
            venv llamafactory "$PY" "$root" "llamafactory==0.9.5"
            lf="$work/venv-llamafactory/bin/python"
            if ! "$lf" -c "import torchaudio, torchvision" 2>/dev/null; then
                # PyPI's torch 2.13.0 (a CUDA build; it runs on the CPU) instead of this machine's local CPU build,
                # whose ABI torchvision's and torchaudio's PyPI wheels do not match; --isolated: without the
                # machine's pip configuration that prefers the local wheel
                "$lf" -m pip uninstall -q -y torch
                cert=(); [ -f /etc/ssl/certs/ca-certificates.crt ] && cert=(--cert /etc/ssl/certs/ca-certificates.crt)
                "$lf" -m pip --isolated install -q "${cert[@]}" "torch==2.13.0" "torchvision==0.28.0"
            fi ;;
        axolotl) venv axolotl "$PY312" "$root" "axolotl==0.21.0" ;;
        *) echo "unknown tool $tool" >&2; exit 2 ;;
    esac
    echo "integrations: $tool venv ready in $(( $(date +%s) - t0 )) s"
done
status=0
"$PY" .ci/integrations/run.py "$work" $TOOLS || status=$?
mkdir -p docs/results
{
    echo "# make test-integrations: last output"
    echo
    echo "Commit $commit (megatrain as installed at the start), $(date -u +%Y-%m-%d), $(nproc) CPU cores,"
    echo "whole job $(( $(date +%s) - started )) s (venvs made in this run: $([ -n "${WORK:-}" ] && echo 'reused where present' || echo 'all'))."
    echo
    for tool in $TOOLS; do
        echo "- $tool venv: $("$work/venv-$tool/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|trl|llamafactory|axolotl) ' | awk '{printf "%s %s, ", $1, $2}')"
    done
    echo
    cat "$work/results.md"
} > docs/results/integrations.md
cat docs/results/integrations.md
echo "integrations: done in $(( $(date +%s) - started )) s"
exit $status
