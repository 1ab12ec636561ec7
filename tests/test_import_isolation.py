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


def test_rooms_keep_their_places():
    """train/ holds the loop and its stages only (at most 14 modules, capacity planning outside it), every
    subpackage on disk is reachable as `jaxrl_llm.<name>`, and nothing the training run imports reaches into
    capacity planning (`capacity` reads the run's config and step functions, never the other way)."""
    import ast
    import pathlib

    import jaxrl_llm

    root = pathlib.Path(jaxrl_llm.__file__).parent
    train_modules = sorted(p.stem for p in (root / "train").glob("*.py"))
    assert len(train_modules) <= 14, train_modules
    assert not {"memory", "aot", "estimate", "compile"} & set(train_modules)
    on_disk = {p.parent.name for p in root.glob("*/__init__.py")}
    assert on_disk == set(jaxrl_llm._SUBPACKAGES), on_disk ^ set(jaxrl_llm._SUBPACKAGES)
    for room in ("train", "run", "sampling", "models", "objectives"):
        for path in (root / room).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert not node.module.startswith("jaxrl_llm.capacity"), f"{room}/{path.name} imports {node.module}"


MAX_FUNCTION_LINES = 100


def _long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method of `source` over `limit` lines, its docstring included."""
    import ast

    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_no_function_is_over_100_lines():
    """Every function and method in jaxrl_llm/ fits in 100 lines (from its `def` to its last line, nested functions
    counted in their outer one too): a longer one is split into named steps. The walk itself finds a 101-line
    function, nested or not, and lets a 100-line one pass."""
    import pathlib
    import textwrap

    import jaxrl_llm

    body = "".join(f"    x{i} = {i}\n" for i in range(99))
    assert _long_functions(f"def ok():\n{body}") == []
    assert _long_functions(f"def long():\n{body}    return x0\n") == [("long", 101)]
    inner = textwrap.indent(f"def inner():\n{body}    return 0\n", " " * 8)
    nested = f"class A:\n    def outer(self):\n{inner}"
    assert _long_functions(nested) == [("outer", 102), ("inner", 101)]
    root = pathlib.Path(jaxrl_llm.__file__).parent
    found = {f"{path.relative_to(root)}: {name}": lines for path in sorted(root.rglob("*.py"))
             for name, lines in _long_functions(path.read_text())}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"
