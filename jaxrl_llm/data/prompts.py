"""Prompt templates: chat prompts through the tokenizer's chat template, or raw text for base models.

The default chat prompt is DESIGN.md's: system "Please reason step by step, and put your final answer
within \\boxed{}." and the user turn = problem + " Let's think step by step and output the final answer
within \\boxed{}". Few-shot exemplars become (user, assistant) turns before the question.
Prompts longer than ``max_prompt_tokens`` are dropped and counted, never truncated.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_USER_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}"

# Single-step exemplars for the 2-term, 1-digit arithmetic task; both problems are in its training
# split (tests check), so the held-out evaluation never shows the model its own answers.
PYTHON_TOOL_SYSTEM = ("You can run Python: write a ```python block, and its output comes back in an ```output "
                      "block. Put the final answer in \\boxed{}.")
PYTHON_TOOL_EXEMPLARS = (
    ("Calculate 23 * 41.", "```python\nprint(23 * 41)\n```\n```output\n943\n```\n23 * 41 = 943 \\boxed{943}"),
    ("Calculate 7 + 5.", "7 + 5 = 12 \\boxed{12}"),
    ("Calculate 318 - 64 * 2.",
     "```python\nprint(318 - 64 * 2)\n```\n```output\n190\n```\n318 - 64 * 2 = 190 \\boxed{190}"),
)
ARITHMETIC_EXEMPLARS = (
    ("Calculate 8 - 3.", "8 - 3 = 5 \\boxed{5}"),
    ("Calculate 4 + 3.", "4 + 3 = 7 \\boxed{7}"),
)


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """How a question becomes a prompt.

    chat=True: messages [system?] + [user shot_q, assistant shot_a]* + [user question], rendered by the
    tokenizer's chat template with the generation prompt. chat=False: raw text
    ``raw_format(shot_1) + " " + answer_1 + raw_separator + ... + raw_format(question)``.
    The user text is ``user_prefix + question + user_suffix`` (exemplar questions get the same wrapping).
    ``add_special_tokens`` is passed to ``encode`` (True for base models that expect a BOS token).
    ``tools``: function schemas the chat template renders (``apply_chat_template(..., tools=)``; tools.format chat).
    """

    system: str | None = DEFAULT_SYSTEM_PROMPT
    user_prefix: str = ""
    user_suffix: str = DEFAULT_USER_SUFFIX
    fewshot: tuple[tuple[str, str], ...] = ()
    chat: bool = True
    raw_format: str = "Question: {question}\nAnswer:"
    raw_separator: str = "\n\n"
    add_special_tokens: bool = False
    tools: tuple[dict, ...] = ()

    def __post_init__(self):
        if not self.chat and "{question}" not in self.raw_format:
            raise ValueError("raw_format must contain '{question}'")
        for shot in self.fewshot:
            if len(shot) != 2 or not all(isinstance(part, str) for part in shot):
                raise ValueError(f"each few-shot exemplar must be a (question, answer) pair of strings, got {shot!r}")

    def user_text(self, question: str) -> str:
        return f"{self.user_prefix}{question}{self.user_suffix}"

    def messages(self, question: str) -> list[dict]:
        """Chat messages for ``question`` (system turn only when ``system`` is not None/empty)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for shot_question, shot_answer in self.fewshot:
            messages += [{"role": "user", "content": self.user_text(shot_question)},
                         {"role": "assistant", "content": shot_answer}]
        return messages + [{"role": "user", "content": self.user_text(question)}]

    def render(self, question: str, tokenizer: ChatTokenizer | None = None) -> str:
        """The prompt text (chat prompts need the tokenizer for its chat template)."""
        if self.chat:
            if tokenizer is None:
                raise ValueError("a chat prompt needs a tokenizer with apply_chat_template")
            tools = {"tools": list(self.tools)} if self.tools else {}
            return tokenizer.apply_chat_template(self.messages(question), add_generation_prompt=True, **tools)
        shots = [f"{self.raw_format.format(question=self.user_text(q))} {a}" for q, a in self.fewshot]
        return self.raw_separator.join(shots + [self.raw_format.format(question=self.user_text(question))])


PROMPT_PRESETS = {
    "reasoning": PromptTemplate(),
    "arithmetic-2shot": PromptTemplate(system=None, user_suffix="", fewshot=ARITHMETIC_EXEMPLARS),
    # One more exemplar with a negative result, which the 2-shot prompt almost never gets right.
    "arithmetic-3shot": PromptTemplate(system=None, user_suffix="",
                                       fewshot=ARITHMETIC_EXEMPLARS + (("Calculate 2 - 7.", "2 - 7 = -5 \\boxed{-5}"),)),
    # Tool use (`tools.env: python`): a system prompt naming the tool and its Markdown format, two exemplars that
    # call it and one that does not (tools.env's output blocks are written as the environment writes them).
    "python-tool-3shot": PromptTemplate(system=PYTHON_TOOL_SYSTEM, user_suffix="", fewshot=PYTHON_TOOL_EXEMPLARS),
    "raw": PromptTemplate(chat=False),
    # The bare question and "=" (for small models trained from scratch on a procedural task).
    "bare": PromptTemplate(chat=False, system=None, user_suffix="", raw_format="{question}="),
}


def prompt_template(preset: str | PromptTemplate = "reasoning", **overrides) -> PromptTemplate:
    """A preset by name ("reasoning", "arithmetic-2shot", "raw") or a template, with fields overridden."""
    if isinstance(preset, PromptTemplate):
        template = preset
    elif preset in PROMPT_PRESETS:
        template = PROMPT_PRESETS[preset]
    else:
        raise KeyError(f"unknown prompt preset {preset!r}; known: {sorted(PROMPT_PRESETS)}")
    if "fewshot" in overrides and overrides["fewshot"] is not None:
        overrides["fewshot"] = tuple(tuple(shot) for shot in overrides["fewshot"])
    if "tools" in overrides:
        overrides["tools"] = tuple(overrides["tools"] or ())
    return dataclasses.replace(template, **overrides)


@dataclasses.dataclass
class PromptStats:
    """What ``build_prompts`` kept and dropped; ``dropped_ids`` lists the first few dropped records."""

    kept: int
    dropped: int
    longest_kept: int
    max_prompt_tokens: int | None
    dropped_ids: list[str]


def build_prompts(records: Sequence[dict], tokenizer: ChatTokenizer, template: PromptTemplate | str = "reasoning",
                  *, max_prompt_tokens: int | None = None, show: int = 5) -> tuple[list[dict], PromptStats]:
    """Records with ``"prompt"`` (text) and ``"prompt_ids"`` (token ids) added; over-long ones dropped.

    A prompt of more than ``max_prompt_tokens`` tokens is dropped (counted in the stats, logged),
    never truncated. Raises ValueError when every prompt is too long.
    """
    template = prompt_template(template)
    kept, dropped_ids, dropped, longest = [], [], 0, 0
    for record in records:
        text = template.render(record["question"], tokenizer)
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=template.add_special_tokens)]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            dropped += 1
            if len(dropped_ids) < show:
                dropped_ids.append(f"{record.get('id')} ({len(ids)} tokens)")
            continue
        longest = max(longest, len(ids))
        kept.append({**record, "prompt": text, "prompt_ids": ids})
    stats = PromptStats(len(kept), dropped, longest, max_prompt_tokens, dropped_ids)
    if dropped:
        message = (f"dropped {dropped} of {len(records)} prompts longer than {max_prompt_tokens} tokens; "
                   f"first: {', '.join(dropped_ids)}")
        if not kept:
            raise ValueError(f"every prompt is too long: {message}")
        logger.warning(message)
    return kept, stats
