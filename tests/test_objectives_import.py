"""`jaxrl_llm.objectives` must import with only jax and numpy installed."""

import ast
import json
import pathlib
import subprocess
import sys

import jaxrl_llm.objectives

HEAVY = ("flax", "optax", "orbax", "transformers", "torch", "tensorflow", "grain", "sympy")
ALLOWED_TOP_LEVEL = {"jax", "numpy", "jaxrl_llm", "__future__"} | set(sys.stdlib_module_names)


def test_import_in_fresh_interpreter_loads_no_heavy_dependency():
    code = (
        "import json, sys, jaxrl_llm.objectives\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "siblings = sorted(m for m in sys.modules\n"
        "                  if m.startswith('jaxrl_llm.') and not m.startswith('jaxrl_llm.objectives'))\n"
        "print(json.dumps([heavy, siblings, 'jax' in sys.modules]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    heavy, siblings, jax_loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert heavy == [], f"importing jaxrl_llm.objectives loaded {heavy}"
    assert siblings == [], f"importing jaxrl_llm.objectives loaded {siblings}"
    assert jax_loaded  # the check ran in an interpreter that really imported the package


def test_sources_import_only_jax_numpy_and_stdlib():
    package_dir = pathlib.Path(jaxrl_llm.objectives.__file__).parent
    for source in sorted(package_dir.glob("*.py")):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in ALLOWED_TOP_LEVEL, f"{source.name} imports {name}"
                if top == "jaxrl_llm":
                    assert name.startswith("jaxrl_llm.objectives"), f"{source.name} imports {name}"
