"""Print README.md's two commands (the bash blocks under "## Two commands"), one per line, in order.

.ci/run runs exactly these, so CI follows README when its commands change. Exits 1 naming the problem
when the section or its two blocks are missing.
"""

import pathlib
import re
import sys

readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
section = re.search(r"^## Two commands\n(.*?)(?=^## )", text, re.M | re.S)
if section is None:
    sys.exit(f"{readme}: no '## Two commands' section")
blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)
commands = [" ".join(line.strip() for line in block.strip().splitlines()) for block in blocks]
if len(commands) != 2 or not all(commands):
    sys.exit(f"{readme}: '## Two commands' must hold exactly two bash blocks, found {len(commands)}")
print("\n".join(commands))
