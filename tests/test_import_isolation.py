"""Other codebases import only the objectives and rewards: those must not pull in heavy frameworks."""

import importlib.util
import subprocess
import sys

import pytest

HEAVY = ("flax", "transformers", "grain", "torch")


@pytest.mark.parametrize("module", ["jaxrl_llm.objectives", "jaxrl_llm.rewards"])
def test_light_modules_do_not_import_heavy_frameworks(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


def test_models_package_imports_no_torch():
    code = "import sys, jaxrl_llm.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
