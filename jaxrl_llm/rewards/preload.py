"""Importing this module imports and warms up the verifier (sympy, the LaTeX parser, its caches).

`VerifierPool` names it as the forkserver's preload module: every worker then forks from a process
whose parser is already warm, so a replacement for a killed worker is ready in milliseconds.
"""

from jaxrl_llm.rewards.parse import warm_up

warm_up()
