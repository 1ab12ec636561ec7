"""Tool calls in the chat template's own format (`tools.format: chat`, `tools.chat_env`): the tools' schemas in the
prompt, calls read from the model's text with the markers the template itself writes, observations exactly what the
template adds for the tool message and the next generation prompt, and a conversation sampled with them (the
observation tokens out of the loss mask). No network: the tokenizer is built here, one token per byte plus the
chat-format tokens, around a small Jinja template written for these tests in the Qwen2.5 convention."""

import json

import jax
import numpy as np
import pytest

from jaxrl_llm.data import build_prompts, prompt_template
from jaxrl_llm.models.tokenizer import Tokenizer
from jaxrl_llm.sampling import FINISH_STOP, Rollout
from jaxrl_llm.sampling import multiturn
from jaxrl_llm.tools import ToolResult
from jaxrl_llm.tools.chat_env import (ChatFormat, ChatTemplateError, ChatTool, ChatToolEnv, chat_format,
                                      chat_tool_env, tool_schemas)
from jaxrl_llm.tools.env import TurnResult

# A system turn listing the tools' schemas (when given), calls as <tool_call>{"name": ..., "arguments": ...}
# </tool_call> in the assistant turn, tool results in a user turn as <tool_response>...</tool_response>.
TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools you may call, as JSON schemas:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call one, write <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- if call.function is defined %}{%- set call = call.function %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # added, not special (as Qwen's)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
AFTER_42 = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def chat_tokenizer(template: str = TEMPLATE) -> Tokenizer:
    """The project's `Tokenizer` over a byte-level BPE without merges (one token per byte), <|endoftext|> (pad),
    <|im_start|>, <|im_end|> (eos) and the four tool markers: 263 ids."""
    import transformers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return Tokenizer(transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False))


TOK = chat_tokenizer()
IM_END, CLOSE_ID = TOK.encode("<|im_end|>")[0], TOK.encode("</tool_call>")[0]


def test_the_prompt_holds_the_tools_schemas():
    schema = tool_schemas("calculator")[0]
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["properties"].keys() == {"expression"}
    assert tool_schemas("python")[0]["function"]["parameters"]["required"] == ["code"]
    template = prompt_template("reasoning", tools=tool_schemas("calculator"))
    [record], _ = build_prompts([{"id": "a", "question": "What is 6 * 7?", "answer": "42"}], TOK, template)
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    assert record["prompt"] == (
        f"<|im_start|>system\n{system}\n\nTools you may call, as JSON schemas:\n<tools>\n{json.dumps(schema)}\n"
        "</tools>\nTo call one, write <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWhat is 6 * 7? Let's think step by step and output the final answer within \\boxed{}"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert record["prompt_ids"] == TOK.encode(record["prompt"])
    # without tools the same template renders no tool section
    [plain], _ = build_prompts([{"id": "a", "question": "What is 6 * 7?", "answer": "42"}], TOK, "reasoning")
    assert "<tools>" not in plain["prompt"]


def test_the_run_renders_the_schemas_only_in_the_chat_format():
    from jaxrl_llm.run.config import ConfigError
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.rollouts import run_prompt_template

    assert run_prompt_template(load_config(None, ["tools.env=calculator"])) == "arithmetic-3shot"
    chat = run_prompt_template(load_config(None, ["tools.env=calculator", "tools.format=chat"]))
    assert chat.tools == tuple(tool_schemas("calculator")) and chat.fewshot == prompt_template("arithmetic-3shot").fewshot
    with pytest.raises(ConfigError, match="data.prompt='raw'"):
        run_prompt_template(load_config(None, ["tools.env=calculator", "tools.format=chat", "data.prompt=raw"]))
    with pytest.raises(ConfigError, match="tools.format"):
        load_config(None, ["tools.format=json"])


def test_the_call_format_is_read_from_the_template():
    assert chat_format(TOK) == ChatFormat("<tool_call>", "</tool_call>", "name", "arguments")
    env = chat_tool_env(TOK, "calculator")
    assert env.stop_strings == ("</tool_call>",) and not env.paired_stops  # one token: a turn stops at it
    assert multiturn.stop_token_ids(TOK, env.stop_strings) == (CLOSE_ID,)
    # another convention, markers of several tokens and other keys: read from the rendering as well
    other = (TEMPLATE.replace('<tool_call>\\n{"name": ', '[CALL] {"tool": ').replace(', "arguments": ', ', "input": ')
             .replace("}\\n</tool_call>", "} [/CALL]"))
    assert "[CALL]" in other and "[/CALL]" in other
    tok = chat_tokenizer(other)
    env = chat_tool_env(tok, "calculator")
    assert env.format == ChatFormat("[CALL]", "[/CALL]", "tool", "input")
    assert env.stop_strings == ("]",)  # not one token: every token holding its last piece stops, the rest decode on
    assert env.step({}, "[CALL] {\"tool\": \"calculator\", \"input\": {\"expression\": \"x[1]", ended=False) == \
        TurnResult("continue")
    turn = env.step({}, '[CALL] {"tool": "calculator", "input": {"expression": "6 * 7"}} [/CALL]', ended=False)
    assert turn.action == "observe" and turn.tool_call and "<tool_response>\n42\n</tool_response>" in turn.observation


def _renderings(tok, name, arguments, content, tools):
    user = [{"role": "user", "content": "Probe question."}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
    without = tok.apply_chat_template(user + [call], add_generation_prompt=False, tools=tools)
    with_tool = tok.apply_chat_template(user + [call, {"role": "tool", "name": name, "content": content}],
                                        add_generation_prompt=True, tools=tools)
    return without, with_tool


def test_a_call_is_parsed_run_and_answered_with_the_template_difference():
    env = chat_tool_env(TOK, "calculator")
    turn = env.step({}, "Let me compute.\n" + CALL, ended=False)
    assert (turn.action, turn.tool_call, turn.error, turn.malformed) == ("observe", True, False, False)
    assert turn.observation == AFTER_42
    # the difference of the conversation rendered with and without the tool message (and the generation prompt),
    # after the turn end the template writes behind the call (the model stopped at the marker)
    without, with_tool = _renderings(TOK, "calculator", {"expression": "6 * 7"}, "42", env.schemas)
    assert with_tool.startswith(without)
    turn_end = without[without.rindex("</tool_call>") + len("</tool_call>"):]
    assert turn_end == "<|im_end|>\n" and turn.observation == turn_end + with_tool[len(without):]
    ids = TOK.encode(turn.observation)
    assert ids[0] == IM_END and TOK.decode(ids, skip_special_tokens=False) == AFTER_42
    # the arguments may come as a JSON string; the tool's failure comes back as its error
    assert env.step({}, CALL.replace('{"expression": "6 * 7"}', '"{\\"expression\\": \\"6 * 7\\"}"'),
                    ended=False).observation == AFTER_42
    failed = env.step({}, CALL.replace("6 * 7", "1 / 0"), ended=False)
    assert failed.error and not failed.malformed and "\nerror: division by zero\n" in failed.observation


def test_malformed_and_unknown_calls_and_the_turns_that_are_no_call():
    env = chat_tool_env(TOK, "calculator")

    def answer(text, **kwargs):
        return env.step({}, text, **{"ended": False, **kwargs})

    bad = answer('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"\n</tool_call>')
    assert (bad.action, bad.malformed, bad.error, bad.tool_call) == ("observe", True, True, False)
    assert bad.observation == AFTER_42.replace("\n42\n", "\nerror: malformed tool call: the call is not a JSON object\n")
    no_args = answer('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    assert no_args.malformed and 'needs a string "name" and an object "arguments"' in no_args.observation
    unknown = answer('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>')
    assert (unknown.malformed, unknown.error, unknown.tool_call) == (False, True, False)
    assert "\nerror: unknown tool 'calc'; the tools are calculator\n" in unknown.observation
    assert unknown.observation.endswith("<|im_start|>assistant\n")
    missing = answer('<tool_call>{"name": "calculator", "arguments": {"code": "1"}}</tool_call>')
    assert "error: tool 'calculator' takes a string argument 'expression'" in missing.observation
    stray = answer("so it is 42 </tool_call>")  # a closing marker alone
    assert stray.malformed and "error: malformed tool call: </tool_call> without <tool_call> before it" in \
        stray.observation
    assert answer("<tool_call>\n{") == TurnResult("continue")  # inside a call (a stop of a longer marker)
    assert answer(CALL, calls_left=0) == TurnResult("end")  # past tools.max_turns: not run
    assert answer('<tool_call>\n{"name": "calc', ended=True) == TurnResult("end", malformed=True)
    assert answer("\\boxed{42}", ended=True) == TurnResult("end")


def test_a_long_output_is_cut_to_the_observation_budget():
    env = ChatToolEnv(TOK, (ChatTool("shout", "text", lambda text: ToolResult("x" * 300, "", 0, False)),),
                      max_observation_tokens=80)
    turn = env.step({}, '<tool_call>{"name": "shout", "arguments": {"text": "a"}}</tool_call>', ended=False)
    assert len(TOK.encode(turn.observation)) == 80  # one token per byte: exactly full
    head = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    tail = "\n[output truncated]\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert turn.observation == head + "x" * (80 - len(TOK.encode(head + tail))) + tail
    with pytest.raises(ChatTemplateError, match="max_observation_tokens = 40"):
        ChatToolEnv(TOK, env.tools, max_observation_tokens=40)


def test_templates_that_re_render_the_call_turn_or_the_prompt():
    # Qwen3's habit: the last assistant turn gets an empty think block, not one a tool message follows
    thinking = TEMPLATE.replace("{{- '<|im_start|>assistant' }}",
                                "{{- '<|im_start|>assistant' }}{%- if loop.last %}{{- '\\n<think>\\n\\n</think>\\n' }}"
                                "{%- endif %}")
    tok = chat_tokenizer(thinking)
    env = chat_tool_env(tok, "calculator")
    without, with_tool = _renderings(tok, "calculator", {"expression": "6 * 7"}, "42", env.schemas)
    assert "<think>" in without and not with_tool.startswith(without)
    assert env.step({}, CALL, ended=False).observation == AFTER_42
    # a template whose system turn changes once a tool has answered: the prompt is no prefix, said at start
    moving = TEMPLATE.replace("'Tools you may call", "('Tools you used' if messages[-1].role == 'tool' else "
                                                      "'Tools you may call')+ '")
    with pytest.raises(ChatTemplateError, match="not a prefix"):
        chat_tool_env(chat_tokenizer(moving), "calculator")


def test_a_template_without_a_tool_role_is_refused_at_start():
    """The bundled SmolLM2's template renders neither tool schemas nor tool calls: a ConfigError naming the key
    and the model."""
    from jaxrl_llm.models.bundled import bundled_gguf_path
    from jaxrl_llm.run.config import ConfigError, ToolsSection
    from jaxrl_llm.train.rollouts import make_tool_use

    smollm = Tokenizer.from_gguf(bundled_gguf_path())
    with pytest.raises(ChatTemplateError, match="no tool role: it renders no tool schemas"):
        chat_format(smollm)
    with pytest.raises(ConfigError, match=r"'tools.format'='chat'.* model 'bundled'.*no tool role"):
        make_tool_use(ToolsSection(env="calculator", format="chat"), smollm, model="bundled")
    assert make_tool_use(ToolsSection(env="calculator"), smollm, model="bundled").env.stop_strings == ("```",)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_format(chat_tokenizer(template=None))


class ScriptedTurns:
    """A stand-in for `generate` over one conversation: call i replies with the forced prefix (the conversation
    so far) then `turns[i]`, stopped (log-prob -0.5 per token). Records every call's row context."""

    def __init__(self, turns):
        self.turns, self.calls = turns, []

    def __call__(self, params, config, contexts, *, max_new_tokens, forced_prefixes=None, **kwargs):
        forced = list((forced_prefixes or [[]])[0])
        self.calls.append(list(contexts[0]) + forced)
        reply = forced + self.turns[len(self.calls) - 1]
        tokens = np.zeros((1, max_new_tokens), np.int32)
        tokens[0, :len(reply)] = reply
        mask = (np.arange(max_new_tokens) < len(reply)).astype(np.float32)[None]
        rollout = Rollout(np.zeros(1, np.int32), tokens, mask, -0.5 * mask, np.array([len(reply)], np.int32),
                          np.array([FINISH_STOP], np.int32))
        return rollout, multiturn.SlotStats(slots=1, iterations=len(reply), useful_slot_steps=len(reply))


def test_a_conversation_in_the_chat_format_masks_the_observation():
    env = chat_tool_env(TOK, "calculator", max_observation_tokens=64)
    template = prompt_template("reasoning", tools=env.schemas)
    [record], _ = build_prompts([{"id": "a", "question": "What is 6 * 7?", "answer": "42"}], TOK, template)
    call, answer = TOK.encode(CALL), TOK.encode("\nSo \\boxed{42}") + [IM_END]
    assert call[-1] == CLOSE_ID
    policy = ScriptedTurns([call, answer])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiturn, "generate", policy)
        out = multiturn.generate_multiturn(None, None, TOK, [record], env, num_samples=1, max_new_tokens=200,
                                           max_observation_tokens=64, rng=jax.random.key(0))
    observation = TOK.encode(AFTER_42)
    n = len(call) + len(observation) + len(answer)
    assert out.tokens[0, :n].tolist() == call + observation + answer and out.lengths.tolist() == [n]
    assert out.mask[0, :n].tolist() == [1.0] * len(call) + [0.0] * len(observation) + [1.0] * len(answer)
    assert np.allclose(out.logprobs[0], -0.5 * out.mask[0])
    assert (out.turns.tolist(), out.tool_calls.tolist(), out.tool_errors.tolist(), out.rounds) == ([2], [1], [0], 2)
    assert out.model_text == [CALL + "\nSo \\boxed{42}"]  # what gets scored: the model's tokens only
    # the second turn decodes from the prompt, the sampled call and the template's observation, token for token
    assert policy.calls[1] == record["prompt_ids"] + call + observation


def test_a_random_policy_samples_conversations_in_the_chat_format():
    """A tiny random policy (the call markers made likely) samples conversations with the real sampler: each
    observation appended is exactly the environment's answer to the model's turn before it, encoded, with mask 0
    and log-prob 0, and the trainer's log-probs of the model's tokens equal the sampler's."""
    from jaxrl_llm.train.logprobs import response_logprobs
    from jaxrl_llm.train.packing import pack_groups, unpack
    from tests.tiny_models import tiny_sampler_model

    env = chat_tool_env(TOK, "calculator", max_observation_tokens=72)
    config, params = tiny_sampler_model(vocab_size=264)
    opener = TOK.encode("<tool_call>")[0]
    params["embed"] = params["embed"].at[jax.numpy.array([opener, CLOSE_ID])].multiply(6.0)
    records = [{"prompt_ids": TOK.encode("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")}]
    out = multiturn.generate_multiturn(params, config, TOK, records, env, num_samples=4, max_new_tokens=160,
                                       max_turns=2, max_observation_tokens=72, rng=jax.random.key(1))
    seen = 0
    for row in range(4):
        tokens, mask = out.tokens[row, :out.lengths[row]].tolist(), out.mask[row, :out.lengths[row]]
        start = i = 0
        while i < len(tokens):
            if mask[i] == 0:  # an observation: the answer to the model's text since the last one
                text = TOK.decode(tokens[start:i])
                expected = TOK.encode(env.step({}, text, ended=False).observation)
                assert tokens[i:i + len(expected)] == expected and not mask[i:i + len(expected)].any()
                i = start = i + len(expected)
                seen += 1
            else:
                i += 1
    assert 0 < seen <= out.tool_calls.sum()  # a last observation with no room after it is not appended
    assert (out.logprobs[out.mask == 0] == 0).all()
    batch = pack_groups([records[0]["prompt_ids"]], [np.arange(4)], out.tokens, out.lengths, masks=out.mask)
    trainer = unpack(np.asarray(response_logprobs(params, config, batch)), [np.arange(4)], 4)
    on = out.mask > 0
    np.testing.assert_allclose(trainer[on], out.logprobs[on], atol=2e-4)
