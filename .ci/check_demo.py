"""Check the demo's output (a log file): the run finished and held-out accuracy rose by more than
MIN_SD times the noise sd the run itself reports, on its line

    held-out accuracy: 0.527 -> 0.830 (change +0.303; the noise between two evaluations of one model is
    0.027 sd, so this is 11.2 sd)
"""

import re
import sys

MIN_SD = 5.0

log = open(sys.argv[1], errors="replace").read()
match = re.search(r"held-out accuracy: ([\d.]+) -> ([\d.]+) \(change ([-+][\d.]+);.*?so this is (-?[\d.]+|inf) sd\)",
                  log, re.S)
if match is None:
    sys.exit("demo check: no 'held-out accuracy: A -> B (...)' line in the demo's output: the run did not finish")
before, after, _, sd = match.groups()
if "policy exported to" not in log[match.end():]:
    sys.exit("demo check: the run did not report its exported policy after the evaluation")
if not float(sd) > MIN_SD:
    sys.exit(f"demo check: held-out accuracy {before} -> {after} is {sd} sd of noise, not more than {MIN_SD}")
print(f"demo check: held-out accuracy {before} -> {after}, {sd} sd of noise (> {MIN_SD}): ok")
