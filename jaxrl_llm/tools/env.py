"""Multi-turn environments: what answers each assistant turn of a tool-using rollout.

A conversation starts from the record's prompt (the run's prompt template: for tool use a system prompt that
describes the tool and few-shot turns that call it, e.g. the `python-tool-3shot` preset). The sampler decodes an
assistant turn until a stop: the end of sequence, the token budget, or a token whose text holds one of the
environment's `stop_strings` (a code fence). The environment then reads the text the model wrote since the last
observation and answers one of three ways:

  continue   the stop did not end a tool call (the fence opened a block): decode on, nothing appended
  observe    a tool call ended: run it, and append its output (loss mask 0) before the next turn
  end        the model finished (end of sequence, or the budget): the conversation is scored

The text format (no chat template of the bundled model has a tool role) is Markdown's: a fenced block tagged with
the tool's name is a call, and its result comes back as a fenced `output` block:

    ```python
    print(23 * 41)
    ```
    ```output
    943
    ```
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable, Protocol

from jaxrl_llm.tools.calculator import calculator
from jaxrl_llm.tools.sandbox import ToolResult, run_python

FENCE = "```"
ACTIONS = ("continue", "observe", "end")


@dataclasses.dataclass(frozen=True)
class TurnResult:
    """An environment's answer to one assistant turn: `action` (continue / observe / end), the observation text
    to append (observe), and what the tool call did."""

    action: str
    observation: str = ""
    tool_call: bool = False  # a call ran
    error: bool = False  # it exited non-zero (an exception in the code, a refused expression)
    timed_out: bool = False
    malformed: bool = False  # the conversation ended inside an unclosed call block
    seconds: float = 0.0  # wall time of the tool

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"TurnResult.action must be one of {ACTIONS}, got {self.action!r}")


class Environment(Protocol):
    """What `sampling.multiturn.generate_multiturn` drives. `step` is called from worker threads, several
    conversations at once; it must not hold state across conversations."""

    stop_strings: tuple[str, ...]
    # optional: True stops a turn only at every second stop string (a fence that closes a block)
    paired_stops: bool

    def step(self, record: dict, text: str, *, ended: bool, calls_left: int = 1) -> TurnResult:
        """`text`: what the model wrote since the last observation (or since the prompt); `ended`: the turn
        stopped at the end of sequence or the budget, so only "end" is possible; `calls_left`: tool calls the
        conversation may still make (at 0 a call ends it instead of running)."""
        ...


@dataclasses.dataclass(frozen=True)
class CodeBlockEnv:
    """A tool called by a fenced block tagged `tag` (```python ... ```): the block's body goes to `tool`, and
    its stdout (then stderr, on failure) comes back in an ```output block, cut to `max_output_chars` characters
    with a note saying so. The last complete block of the turn is the call; a turn that ends with an unclosed
    block is malformed."""

    tag: str
    tool: Callable[[str], ToolResult]
    max_output_chars: int = 400
    stop_strings: tuple[str, ...] = (FENCE,)
    paired_stops: bool = True  # a turn stops at a fence that closes a block (`sampling.generate`'s pair stops)

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_+-]+", self.tag):
            raise ValueError(f"CodeBlockEnv.tag must be one word, got {self.tag!r}")
        if self.max_output_chars < 16:
            raise ValueError(f"CodeBlockEnv.max_output_chars must be >= 16, got {self.max_output_chars}")

    @property
    def _block(self) -> re.Pattern:
        return re.compile(FENCE + re.escape(self.tag) + r"[ \t]*\n(.*?)" + FENCE, re.S)

    def open_call(self, text: str) -> bool:
        """Whether `text` ends inside a block tagged `tag` (opened, not yet closed)."""
        start = text.rfind(FENCE + self.tag)
        return start >= 0 and text.find(FENCE, start + len(FENCE) + len(self.tag)) < 0

    def step(self, record: dict, text: str, *, ended: bool, calls_left: int = 1) -> TurnResult:
        calls = self._block.findall(text)
        if ended or not calls or self.open_call(text):
            if ended:
                return TurnResult("end", malformed=self.open_call(text))
            return TurnResult("continue")
        if calls_left < 1:
            return TurnResult("end")  # a call past the conversation's limit: not run
        start = time.perf_counter()
        result = self.tool(calls[-1])
        seconds = time.perf_counter() - start
        return TurnResult("observe", observation=self.format_output(result), tool_call=True,
                          error=result.returncode != 0 and not result.timed_out, timed_out=result.timed_out,
                          seconds=seconds)

    def format_output(self, result: ToolResult) -> str:
        """The ```output block of a result (`output_text`)."""
        return f"\n{FENCE}output\n{output_text(result, self.max_output_chars)}\n{FENCE}\n"


def output_text(result: ToolResult, max_output_chars: int) -> str:
    """What a tool's result reads as: stdout, then stderr's last lines on failure, a note on a timeout, cut to
    `max_output_chars` with a note giving the full length."""
    body = result.stdout
    if result.timed_out:
        body += "\nTimeoutError: the program ran out of time"
    elif result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        body += "\n".join(lines[-3:])
    body = body.strip("\n")
    if len(body) > max_output_chars:
        note = f"\n[output truncated: {len(body)} characters, {max_output_chars} shown]"
        body = body[: max_output_chars - len(note)] + note
    return body


def python_env(*, timeout_s: float = 5.0, memory_mb: int = 512, isolation: str = "auto",
               max_output_chars: int = 400) -> CodeBlockEnv:
    """```python blocks run by `tools.run_python` in its sandbox."""

    def tool(code: str) -> ToolResult:
        return run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation)

    return CodeBlockEnv("python", tool, max_output_chars=max_output_chars)


def calculator_env(*, max_output_chars: int = 400) -> CodeBlockEnv:
    """```calculator blocks evaluated exactly by `tools.calculator` (no process, no sandbox needed)."""
    return CodeBlockEnv("calculator", lambda expression: calculator(expression.strip()),
                        max_output_chars=max_output_chars)


ENVIRONMENTS = {"python": python_env, "calculator": calculator_env}
