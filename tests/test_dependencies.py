"""Every module the library imports at run time comes from a declared dependency (pyproject.toml's
`[project] dependencies`, not an extra), so `pip install jaxrl_llm` alone runs every command.

Two checks: the imports written in jaxrl_llm/ (read from the source), and the modules actually loaded
when a fresh interpreter imports every jaxrl_llm module and applies a chat template (imports made by
other libraries on our behalf, such as transformers loading jinja2, show up only there).
"""

import ast
import importlib.metadata as metadata
import json
import pathlib
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Imported only inside try/except with a standard-library fallback (sources.py): never required.
OPTIONAL_SHIMS = {"importlib_resources"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(spec) for spec in project["dependencies"]]


# The accelerator compilers a user adds as extras (libtpu, the CUDA plugin with cuDNN): where installed, jax itself
# loads their plugins when it starts; jaxrl_llm never imports them.
ACCELERATOR_EXTRAS = ("tpu", "gpu-compile")


def accelerator_requirements() -> list[Requirement]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [Requirement(spec) for name in ACCELERATOR_EXTRAS for spec in extras[name]]


def requirement_closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of the distributions that installing `requirements` (no extras of ours) brings in:
    each requirement's own requirements, with their markers evaluated and the extras they ask for."""
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    stack = [(req, "") for req in requirements]
    while stack:
        req, extra = stack.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonical(req.name)
        names.add(name)
        for wanted in [""] + sorted(req.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                nested = metadata.requires(req.name) or []
            except metadata.PackageNotFoundError:
                continue  # not installed in this environment: nothing it brings is loaded either
            stack.extend((Requirement(spec), wanted) for spec in nested)
    return names


def distributions_of(modules) -> dict[str, set[str]]:
    """{top-level module: canonical distribution names} for the modules that come from a distribution."""
    owners = metadata.packages_distributions()
    return {module: {canonical(d) for d in owners[module]} for module in modules if module in owners}


def source_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} over jaxrl_llm/, absolute imports outside the standard library."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "jaxrl_llm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "jaxrl_llm":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_closure_follows_markers_and_extras():
    """The closure itself, on requirements whose answer is known: a marker that is false drops a
    requirement, an extra pulls in that extra's requirements."""
    assert requirement_closure([Requirement('numpy; python_version < "3"')]) == set()
    plain = requirement_closure([Requirement("latex2sympy2_extended")])
    with_extra = requirement_closure([Requirement("latex2sympy2_extended[antlr4_13_2]")])
    assert "sympy" in plain and "antlr4-python3-runtime" in with_extra
    assert canonical("PyYAML") == "pyyaml" and canonical("orbax_checkpoint") == "orbax-checkpoint"


def test_every_import_in_the_source_is_a_declared_dependency():
    declared = {canonical(req.name) for req in declared_requirements()}
    imports = source_imports()
    owners = distributions_of(imports)
    missing = {module: sorted(files) for module, files in imports.items()
               if module not in OPTIONAL_SHIMS and not owners.get(module, set()) & declared}
    assert not missing, f"imported in jaxrl_llm/ but not a declared dependency in pyproject.toml: {missing}"


LOAD_EVERYTHING = r"""
import sys
at_start = set(sys.modules)  # the interpreter's own start-up (site hooks of the environment), not ours
import importlib, json, pkgutil, pathlib
import jaxrl_llm
for info in pkgutil.walk_packages(jaxrl_llm.__path__, "jaxrl_llm."):
    importlib.import_module(info.name)
sys.path.insert(0, sys.argv[1])
from tiny_gguf import tiny_gguf_path
from jaxrl_llm.models.tokenizer import Tokenizer
from jaxrl_llm.rewards import math_reward
tokenizer = Tokenizer.from_gguf(tiny_gguf_path(pathlib.Path(sys.argv[2])))
text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2?"}], add_generation_prompt=True)
assert text.endswith("<|im_start|>assistant\n"), text
assert math_reward("so \\boxed{3}", "3") == 1.0
print(json.dumps(sorted({name.split(".")[0] for name in set(sys.modules) - at_start})))
"""


def test_modules_loaded_at_run_time_come_from_declared_dependencies(tmp_path):
    """A fresh interpreter imports every jaxrl_llm module, builds a tokenizer and applies its chat
    template (transformers imports jinja2 there), and verifies an answer; every module it then holds
    must come from a declared dependency or one of theirs (as installed without the test extra), or from the
    accelerator extras whose plugins jax loads at start where they are installed."""
    result = subprocess.run([sys.executable, "-c", LOAD_EVERYTHING, str(ROOT / "tests"), str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    allowed = requirement_closure(declared_requirements()) | {"jaxrl-llm"}
    plugins = requirement_closure(accelerator_requirements()) - allowed
    assert {"jax-cuda12-plugin", "nvidia-cudnn-cu12", "libtpu"} <= plugins, plugins
    allowed |= plugins
    owners = distributions_of(loaded)
    stray = {module: sorted(dists) for module, dists in owners.items()
             if module not in OPTIONAL_SHIMS and not dists & allowed}
    assert not stray, (f"modules loaded at run time from distributions that installing jaxrl_llm does not "
                       f"bring in (declare them in pyproject.toml): {stray}")
