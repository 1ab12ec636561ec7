"""Tool calls in the model's own chat format (`tools.format: chat`): the tokenizer's chat template with a tool role.

Families such as Qwen2.5 and Qwen3 ship chat templates that take `apply_chat_template(messages, tools=[schema])`:
the tools' JSON schemas go into the system turn, the model calls one as

    <tool_call>
    {"name": "python", "arguments": {"code": "print(23 * 41)"}}
    </tool_call>

and the result comes back as a message of role "tool", which the template renders (Qwen: inside a user turn, as
<tool_response>...</tool_response>). Nothing here is written for one family: `chat_format` renders a probe
conversation (a user turn, an assistant call of a probe tool, the tool's answer) and reads from it where the call's
JSON sits, the text around it (the call markers) and the JSON keys of the name and the arguments. The observation
after a call is rendered per call too: the conversation with the tool message and the next generation prompt,
from the end of the call on (`ChatToolEnv.observation`), so it is exactly what the template adds.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Mapping, Sequence

from jaxrl_llm.tools.calculator import calculator
from jaxrl_llm.tools.env import TurnResult, output_text
from jaxrl_llm.tools.sandbox import ToolResult, run_python

_PROBE_QUESTION = "Probe question."
_PROBE_NAME = "probe_tool_q7"
_PROBE_ARGUMENTS = {"probe_argument": "probe value 3"}
_PROBE_RESULT = "probe result 5"
_PROBE_ANSWER = "Probe answer."
TRUNCATION_NOTE = "\n[output truncated]"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot carry tool calls (no tool role, or one this module cannot read)."""


@dataclasses.dataclass(frozen=True)
class ChatTool:
    """A tool the chat format offers: `name`, one string `argument` passed to `run`, and their descriptions
    (the JSON schema the template renders into the prompt)."""

    name: str
    argument: str
    run: Callable[[str], ToolResult]
    description: str = ""
    argument_description: str = ""

    @property
    def schema(self) -> dict:
        """The OpenAI-style function schema `apply_chat_template(..., tools=)` takes."""
        return tool_schema(self.name, self.argument, self.description, self.argument_description)


def tool_schema(name: str, argument: str, description: str = "", argument_description: str = "") -> dict:
    """{"type": "function", "function": {name, description, parameters: one required string `argument`}}."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string",
                                                                   "description": argument_description}},
                       "required": [argument]}}}


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, isolation: str = "auto") -> ChatTool:
    """`python` {"code": string}: `tools.run_python` in its sandbox."""
    return ChatTool("python", "code",
                    lambda code: run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation),
                    "Run a Python program in a sandbox; what it prints comes back (the end of the error on failure).",
                    "the program")


def calculator_tool() -> ChatTool:
    """`calculator` {"expression": string}: exact arithmetic (`tools.calculator`)."""
    return ChatTool("calculator", "expression", lambda expression: calculator(expression.strip()),
                    "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
                    "the expression, e.g. 123 * 456")


CHAT_TOOLS = {"python": python_tool, "calculator": calculator_tool}


def tool_schemas(env: str) -> list[dict]:
    """The schemas of the tools `tools.env` names, as the prompt renders them."""
    return [CHAT_TOOLS[env]().schema]


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How a chat template writes a tool call: `call_open` JSON `call_close`, the JSON object's `name_key` and
    `arguments_key` (Qwen: "<tool_call>", "</tool_call>", "name", "arguments")."""

    call_open: str
    call_close: str
    name_key: str
    arguments_key: str


def _call_message(name: str, arguments: Any) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def _render(tokenizer, messages: list[dict], tools: Sequence[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tools=list(tools))
    except Exception as err:  # a template that cannot take the probe (raise_exception, missing fields)
        raise ChatTemplateError(f"its chat template fails on a tool conversation ({type(err).__name__}: "
                                f"{err})") from None


def _find_call(text: str) -> tuple[int, int, dict, str, str] | None:
    """(start, end, object, name key, arguments key) of the first JSON object in `text` holding the probe call."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            name_keys = [k for k, v in obj.items() if v == _PROBE_NAME]
            arg_keys = [k for k, v in obj.items() if v == _PROBE_ARGUMENTS or (
                isinstance(v, str) and v.strip().startswith("{") and _loads(v) == _PROBE_ARGUMENTS)]
            if name_keys and arg_keys:
                return start, end, obj, name_keys[0], arg_keys[0]
        start = text.find("{", start + 1)
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def chat_format(tokenizer) -> ChatFormat:
    """The call markers and JSON keys of the tokenizer's chat template, read from a rendered probe conversation;
    raises ChatTemplateError when the template renders no tool schemas, no tool calls or no tool messages, or
    writes a call with no marker before or after its JSON (a bare JSON call: Llama 3.1's), which a stop cannot
    find."""
    if not getattr(getattr(tokenizer, "hf", None), "chat_template", None):
        raise ChatTemplateError("it has no chat template")
    tools = [tool_schema(_PROBE_NAME, next(iter(_PROBE_ARGUMENTS)))]
    user = [{"role": "user", "content": _PROBE_QUESTION}]
    prompt = _render(tokenizer, user, tools, True)
    if _PROBE_NAME not in prompt:
        raise ChatTemplateError("its chat template has no tool role: it renders no tool schemas (`tools=`)")
    conversation = _render(tokenizer, user + [_call_message(_PROBE_NAME, _PROBE_ARGUMENTS),
                                              {"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}],
                           tools, True)
    if not conversation.startswith(prompt):
        raise ChatTemplateError("its chat template renders the prompt differently once a tool call follows it, so "
                                "the prompt is not a prefix of the conversation")
    after = conversation[len(prompt):]
    found = _find_call(after)
    if found is None:
        raise ChatTemplateError("its chat template has no tool role: it renders no tool calls (an assistant "
                                "message's tool_calls)")
    start, end, _, name_key, arguments_key = found
    if _PROBE_RESULT not in after[end:]:
        raise ChatTemplateError("its chat template has no tool role: it renders no tool messages (role 'tool')")
    before = after[:start].split()
    answered = _render(tokenizer, user + [{"role": "assistant", "content": _PROBE_ANSWER}], tools, False)
    turn_end = answered[answered.rfind(_PROBE_ANSWER) + len(_PROBE_ANSWER):].strip()
    tail = after[end:].lstrip()
    cuts = [tail.find(s) for s in [turn_end, *tokenizer.hf.all_special_tokens] if s and s in tail]
    close = tail[:min(cuts, default=len(tail))].split()
    if not before or not close:
        side = "before" if not before else "after"
        raise ChatTemplateError(f"its chat template writes a tool call with no marker {side} its JSON "
                                f"({after[:end + 20]!r}); only calls between markers are read")
    return ChatFormat(before[-1], close[0], name_key, arguments_key)


@dataclasses.dataclass(frozen=True)
class ChatToolEnv:
    """Tools called in the chat template's own format: a turn stops at the call's closing marker, the JSON
    between the markers names the tool and its arguments, and the tool's output comes back as the template's
    tool message followed by the next generation prompt. A call that does not parse is malformed (counted, and
    the observation says so); an unknown tool or a missing argument gets an error observation. Observations are
    kept within `max_observation_tokens` by cutting the tool's output (`None`: not cut here)."""

    tokenizer: Any
    tools: tuple[ChatTool, ...]
    max_output_chars: int = 400
    max_observation_tokens: int | None = None
    format: ChatFormat = dataclasses.field(init=False)
    stop_strings: tuple[str, ...] = dataclasses.field(init=False)
    paired_stops: bool = dataclasses.field(init=False)

    def __post_init__(self):
        if not self.tools:
            raise ValueError("ChatToolEnv needs at least one tool")
        if self.max_output_chars < 16:
            raise ValueError(f"ChatToolEnv.max_output_chars must be >= 16, got {self.max_output_chars}")
        fmt = chat_format(self.tokenizer)
        for marker in (fmt.call_open, fmt.call_close):
            if marker not in self.tokenizer.decode(self.tokenizer.encode(marker)):
                raise ChatTemplateError(f"the call marker {marker!r} is a special token, which the sampler's "
                                        "decoding drops")
        close_ids = self.tokenizer.encode(fmt.call_close)
        # a marker of one token stops where it is sampled; a longer one at every token holding its last piece
        # (each such stop that does not complete a call decodes on)
        stop = fmt.call_close if len(close_ids) == 1 else self.tokenizer.decode(close_ids[-1:])
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "stop_strings", (stop,))
        # one marker both opening and closing a call (as the Markdown fence): stop at every second
        object.__setattr__(self, "paired_stops", fmt.call_open == fmt.call_close and len(close_ids) == 1)
        object.__setattr__(self, "_prompt", _render(self.tokenizer, [{"role": "user", "content": _PROBE_QUESTION}],
                                                    self.schemas, True))
        if self.max_observation_tokens is not None:
            frame = len(self.tokenizer.encode(self._observation(self.tools[0].name, {}, TRUNCATION_NOTE, "")))
            if frame + 8 > self.max_observation_tokens:
                raise ChatTemplateError(f"its tool message takes {frame} tokens around a cut output; "
                                        f"tools.max_observation_tokens = {self.max_observation_tokens} leaves no "
                                        f"room for the output (needs >= {frame + 8})")

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools]

    def open_call(self, text: str) -> bool:
        """Whether `text` ends inside a call (its opening marker written, its closing one not yet)."""
        fmt = self.format
        if fmt.call_open == fmt.call_close:
            return text.count(fmt.call_open) % 2 == 1
        return text.rfind(fmt.call_open) > text.rfind(fmt.call_close)

    def parse(self, body: str) -> tuple[str | None, Any, str]:
        """(name, arguments, error) of the JSON between the markers; error "" when it is a well-formed call."""
        obj = _loads(body.strip())
        if not isinstance(obj, dict):
            return None, None, "the call is not a JSON object"
        name, arguments = obj.get(self.format.name_key), obj.get(self.format.arguments_key, {})
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return (name if isinstance(name, str) else None), None, (
                f'the call needs a string "{self.format.name_key}" and an object "{self.format.arguments_key}"')
        return name, arguments, ""

    def step(self, record: dict, text: str, *, ended: bool, calls_left: int = 1) -> TurnResult:
        fmt = self.format
        if ended:
            return TurnResult("end", malformed=self.open_call(text))
        close = text.rfind(fmt.call_close)
        if close < 0 or self.open_call(text):
            return TurnResult("continue")  # a stop inside a call, or at a piece of a longer closing marker
        if calls_left < 1:
            return TurnResult("end")  # a call past the conversation's limit: not run
        start = text.rfind(fmt.call_open, 0, close)
        if start < 0:  # a closing marker alone: a malformed call, not a stop to decode on from (a round each)
            name, arguments, problem = None, None, f"{fmt.call_close} without {fmt.call_open} before it"
        else:
            name, arguments, problem = self.parse(text[start + len(fmt.call_open):close])
        tools = {tool.name: tool for tool in self.tools}
        seconds, result = 0.0, None
        if problem:
            content = f"error: malformed tool call: {problem}"
        elif name not in tools:
            content = f"error: unknown tool {name!r}; the tools are {', '.join(tools)}"
        elif not isinstance(arguments.get(tools[name].argument), str):
            content = f"error: tool {name!r} takes a string argument {tools[name].argument!r}"
        else:
            began = time.perf_counter()
            result = tools[name].run(arguments[tools[name].argument])
            seconds = time.perf_counter() - began
            content = output_text(result, self.max_output_chars)
        observation = self.observation(name or self.tools[0].name, arguments or {}, content,
                                       sampled_tail=text[close + len(fmt.call_close):])
        return TurnResult("observe", observation=observation, tool_call=result is not None,
                          error=result is None or (result.returncode != 0 and not result.timed_out),
                          timed_out=result is not None and result.timed_out, malformed=bool(problem),
                          seconds=seconds)

    def observation(self, name: str, arguments: Mapping, content: str, *, sampled_tail: str = "") -> str:
        """What the template writes after a call of `name` when the tool answers `content`: the conversation
        rendered with the tool message and the next generation prompt, from the end of the call's closing marker
        on (the end of the assistant turn, the tool message, the generation prompt), less `sampled_tail` (text
        the model's stop token held after the marker). Cut to `max_observation_tokens` by cutting `content`."""
        render = lambda body: self._observation(name, arguments, body, sampled_tail)  # noqa: E731
        text = render(content)
        if self.max_observation_tokens is None or self._fits(text):
            return text
        ids = self.tokenizer.encode(content)
        kept, over = 0, len(ids)  # the most of the output's tokens that fit with the note (0 always does)
        while kept + 1 < over:
            middle = (kept + over) // 2
            kept, over = (middle, over) if self._fits(render(self._cut(ids, middle))) else (kept, middle)
        return render(self._cut(ids, kept))

    def _fits(self, text: str) -> bool:
        return len(self.tokenizer.encode(text)) <= self.max_observation_tokens

    def _cut(self, ids: list[int], keep: int) -> str:
        return self.tokenizer.decode(ids[:keep]) + TRUNCATION_NOTE

    def _observation(self, name: str, arguments: Mapping, content: str, sampled_tail: str) -> str:
        user = [{"role": "user", "content": _PROBE_QUESTION}]
        call = _call_message(name, dict(arguments))
        without = _render(self.tokenizer, user + [call], self.schemas, False)
        with_tool = _render(self.tokenizer, user + [call, {"role": "tool", "name": name, "content": content}],
                            self.schemas, True)
        if not with_tool.startswith(self._prompt):
            raise ChatTemplateError(f"the chat template renders the prompt differently once a call of {name!r} "
                                    "and its answer follow it: the prompt the model decoded from is not a prefix "
                                    "of the conversation")
        turn_end = without[self._call_end(without):]
        observation = with_tool[self._call_end(with_tool):]
        if not observation.startswith(turn_end):
            raise ChatTemplateError(f"the chat template ends a call's turn with {turn_end!r} when it is last but "
                                    f"not when a tool message follows ({observation[:40]!r})")
        return observation[len(sampled_tail):] if observation.startswith(sampled_tail) else observation

    def _call_end(self, rendered: str) -> int:
        """Where the closing marker of the (one) call in a rendered probe conversation ends."""
        fmt = self.format
        start = rendered.find(fmt.call_open, len(self._prompt)) + len(fmt.call_open)
        body = start + len(rendered[start:]) - len(rendered[start:].lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(rendered, body)
        except ValueError:
            end = body
        close = rendered.find(fmt.call_close, end)
        if start < len(fmt.call_open) or close < 0:
            raise ChatTemplateError(f"the chat template's call of a probe tool has no {fmt.call_open!r} ... "
                                    f"{fmt.call_close!r} after the prompt")
        return close + len(fmt.call_close)


def chat_tool_env(tokenizer, env: str, *, max_output_chars: int = 400, max_observation_tokens: int | None = None,
                  **limits) -> ChatToolEnv:
    """The chat-format environment of the tool `tools.env` names (`limits`: run_python's timeout_s, memory_mb,
    isolation)."""
    return ChatToolEnv(tokenizer, (CHAT_TOOLS[env](**limits),), max_output_chars=max_output_chars,
                       max_observation_tokens=max_observation_tokens)
