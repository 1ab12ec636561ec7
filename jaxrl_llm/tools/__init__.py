"""Tools a policy can call during a rollout: Python in a sandbox, and exact arithmetic."""

from jaxrl_llm.tools.calculator import calculator
from jaxrl_llm.tools.sandbox import (MAX_OUTPUT_BYTES, SandboxUnavailableError, ToolResult, resolve_isolation,
                                     run_python)

__all__ = ["MAX_OUTPUT_BYTES", "SandboxUnavailableError", "ToolResult", "calculator", "resolve_isolation",
           "run_python"]
