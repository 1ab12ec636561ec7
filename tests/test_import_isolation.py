"""Other codebases import only the objectives and rewards: those must not pull in heavy frameworks."""

import importlib.util
import json
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


def test_top_level_package_imports_subpackages_on_demand():
    """`import jaxrl_llm` loads no subpackage and not jax; `jaxrl_llm.objectives.<fn>` then imports the
    objectives alone (the module __getattr__ of PEP 562), without the heavy frameworks or the other subpackages."""
    code = (
        "import json, sys, jaxrl_llm\n"
        "bare = ['jax' in sys.modules, sorted(m for m in sys.modules if m.startswith('jaxrl_llm.'))]\n"
        "import numpy as np\n"
        "adv = jaxrl_llm.objectives.grpo_advantages(np.array([1.0, 0.0]), np.array([0, 0]), scale_by_std=False)\n"
        f"heavy = sorted(m for m in {HEAVY + ('optax', 'orbax')!r} if m in sys.modules)\n"
        "others = sorted(m for m in sys.modules if m.startswith('jaxrl_llm.') and not m.startswith('jaxrl_llm.objectives'))\n"
        "try:\n"
        "    jaxrl_llm.no_such_module\n"
        "    missing = None\n"
        "except AttributeError as err:\n"
        "    missing = str(err)\n"
        "print(json.dumps([bare, [float(a) for a in adv], heavy, others, missing, 'objectives' in dir(jaxrl_llm)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    bare, adv, heavy, others, missing, listed = json.loads(out.stdout.strip().splitlines()[-1])
    assert bare == [False, []], f"import jaxrl_llm alone loaded {bare}"
    assert adv == [0.5, -0.5]  # rewards 1, 0 in one group: r - mean
    assert heavy == [] and others == [], (heavy, others)
    assert missing == "module 'jaxrl_llm' has no attribute 'no_such_module'"
    assert listed
