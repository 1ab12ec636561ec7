"""Multi-turn tool rollouts: the environment's answers (tools.env), the conversation driver
(sampling.multiturn) against a scripted policy, token for token, and on a real model the trainer's log-probs of
the model's tokens against the sampler's (token in, token out; tool output masked out of the loss)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm.sampling import FINISH_LENGTH, FINISH_STOP, Rollout
from jaxrl_llm.sampling import multiturn
from jaxrl_llm.tools import ToolResult
from jaxrl_llm.tools.env import CodeBlockEnv, TurnResult, calculator_env

FENCE_ID, EOS_ID, PAD_ID = 1, 2, 0


class CharTokenizer:
    """One token per ASCII character (id = code point + 3), "```" its own token (1), end of sequence 2."""

    vocab_size = 131
    pad_token_id = PAD_ID
    stop_ids = (EOS_ID,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for i, part in enumerate(text.split("```")):
            if i:
                ids.append(FENCE_ID)
            ids += [ord(ch) + 3 for ch in part]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == FENCE_ID:
                out.append("```")
            elif i >= 3:
                out.append(chr(i - 3))
            elif not skip_special_tokens:
                out.append(["<pad>", "", "<eos>"][i])
        return "".join(out)


TOK = CharTokenizer()


def test_code_block_env_answers_each_kind_of_turn():
    env = calculator_env()
    assert env.step({}, "Let me compute.\n```", ended=False) == TurnResult("continue")  # a fence that opens
    done = env.step({}, "```calculator\n6 * 7\n```", ended=False)
    assert (done.action, done.observation, done.tool_call, done.error) == ("observe", "\n```output\n42\n```\n",
                                                                          True, False)
    assert env.step({}, "```calculator\n1 / 0\n```", ended=False).error
    assert env.step({}, "so \\boxed{42}", ended=True) == TurnResult("end")
    assert env.step({}, "```calculator\n6 *", ended=True) == TurnResult("end", malformed=True)
    # a fence that closes a block of another tag is no call: decode on
    assert env.step({}, "```output\n3\n```", ended=False) == TurnResult("continue")
    assert env.step({}, "```calculator\n6 * 7\n```", ended=False, calls_left=0) == TurnResult("end")  # not run
    long = CodeBlockEnv("python", lambda code: ToolResult("x" * 1000 + "\n", "", 0, False), max_output_chars=60)
    text = long.step({}, "```python\nprint('x' * 1000)\n```", ended=False).observation
    note = "\n[output truncated: 1000 characters, 60 shown]"
    assert text == "\n```output\n" + "x" * (60 - len(note)) + note + "\n```\n"
    slow = CodeBlockEnv("python", lambda code: ToolResult("", "", -9, True))
    out = slow.step({}, "```python\nwhile True: pass\n```", ended=False)
    assert out.timed_out and not out.error and "TimeoutError" in out.observation
    failing = CodeBlockEnv("python", lambda code: ToolResult("", "Traceback\n  File a\n  line\nNameError: y", 1, False))
    assert failing.step({}, "```python\ny\n```", ended=False).observation == \
        "\n```output\n  File a\n  line\nNameError: y\n```\n"


class ScriptedPolicy:
    """A stand-in for `generate`: the reply to a context is the next chunk of `script` (text up to and including
    the next stop id), by how many of the conversation's own characters it already holds; log-prob -0.5 per
    token. A row's context is its prompt, then its forced prefix when given (returned ahead of the reply, as
    `generate` returns it). Records every call's row contexts."""

    def __init__(self, prompt_len: int, script: list[int]):
        self.prompt_len, self.script, self.calls = prompt_len, script, []

    def __call__(self, params, config, contexts, *, num_samples, max_new_tokens, stop_ids, pair_stop_ids=(),
                 forced_prefixes=None, **kwargs):
        counts = np.broadcast_to(np.asarray(num_samples), (len(contexts),))
        prompts = [list(c) for c, n in zip(contexts, counts) for _ in range(n)]
        forced = forced_prefixes or [[] for _ in prompts]
        rows = [p + list(f) for p, f in zip(prompts, forced)]
        self.calls.append(rows)
        tokens = np.zeros((len(rows), max_new_tokens), np.int32)
        lengths = np.zeros(len(rows), np.int32)
        finish = np.full(len(rows), FINISH_LENGTH, np.int32)
        for r, context in enumerate(rows):
            done = self._position(context[self.prompt_len:])  # the model's own tokens so far
            reply, pairs = list(forced[r]), sum(t in pair_stop_ids for t in forced[r])
            for t in self.script[done:]:
                reply.append(t)
                pairs += t in pair_stop_ids
                if t in stop_ids or (t in pair_stop_ids and pairs % 2 == 0) or len(reply) == max_new_tokens:
                    break
            tokens[r, :len(reply)] = reply
            lengths[r] = len(reply)
            ended_at_stop = reply and (reply[-1] in stop_ids or (reply[-1] in pair_stop_ids and pairs % 2 == 0))
            finish[r] = FINISH_STOP if ended_at_stop else FINISH_LENGTH
        mask = (np.arange(max_new_tokens) < lengths[:, None]).astype(np.float32)
        return Rollout(np.arange(len(rows), dtype=np.int32), tokens, mask, -0.5 * mask, lengths, finish), \
            multiturn.SlotStats(slots=len(rows), iterations=int(lengths.max()), useful_slot_steps=int(lengths.sum()))

    @staticmethod
    def _position(own):
        text = TOK.decode(own)
        while "\n```output\n" in text:  # drop each observation the driver appended
            start = text.index("\n```output\n")
            end = text.index("```\n", start + len("\n```output\n")) + len("```\n")
            text = text[:start] + text[end:]
        return len(TOK.encode(text))


def _run(script: str, *, prompt="Q?", samples=1, env=None, **kwargs):
    """The conversation of a policy that writes `script` (then the end of sequence) with `env` (the calculator)."""
    records = [{"prompt_ids": TOK.encode(prompt)}]
    policy = ScriptedPolicy(len(records[0]["prompt_ids"]), TOK.encode(script) + [EOS_ID])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiturn, "generate", lambda *a, **k: policy(*a, **k))
        out = multiturn.generate_multiturn(None, None, TOK, records, env or calculator_env(), num_samples=samples,
                                           rng=jax.random.key(0), **{"max_new_tokens": 120, **kwargs})
    return out, policy


def test_a_conversation_keeps_the_sampled_tokens_and_masks_the_tool_output():
    out, policy = _run("```calculator\n6 * 7\n```\nso \\boxed{42}")
    observation = TOK.encode("\n```output\n42\n```\n")
    call = TOK.encode("```calculator\n6 * 7\n```")
    answer = TOK.encode("\nso \\boxed{42}") + [EOS_ID]
    expected = call + observation + answer
    n = len(expected)
    assert out.lengths.tolist() == [n]
    assert out.tokens[0, :n].tolist() == expected and (out.tokens[0, n:] == PAD_ID).all()
    assert out.mask[0].tolist() == [1.0] * len(call) + [0.0] * len(observation) + [1.0] * len(answer) + [0.0] * (120 - n)
    assert np.allclose(out.logprobs[0], -0.5 * out.mask[0])
    assert (out.turns.tolist(), out.tool_calls.tolist(), out.tool_errors.tolist()) == ([2], [1], [0])
    assert not out.malformed[0] and not out.truncated[0]
    assert out.model_text == ["```calculator\n6 * 7\n```\nso \\boxed{42}"]
    # two sampler rounds: to the fence that closes the call (paired stops), then to the end; the second
    # continues from exactly the tokens sampled before, observation included
    assert out.rounds == 2
    prompt = TOK.encode("Q?")
    assert policy.calls[1][0] == prompt + call + observation
    summary = out.summary()
    assert summary["tool_calls"] == 1.0 and summary["tool_call_rate"] == 1.0 and summary["sampler_rounds"] == 2.0
    # unpaired, a turn also stops at the fence that opens the call: a round more, the same conversation
    unpaired = dataclasses.replace(calculator_env(), paired_stops=False)
    again, policy = _run("```calculator\n6 * 7\n```\nso \\boxed{42}", env=unpaired)
    assert again.rounds == 3 and policy.calls[1][0] == prompt + call[:1] and policy.calls[2][0] == prompt + call + \
        observation
    assert (again.tokens == out.tokens).all() and (again.mask == out.mask).all()


def test_limits_on_calls_observations_and_budget():
    out, _ = _run("```calculator\n1+1\n```\n```calculator\n2+2\n```\ndone", max_turns=1)
    # the second call is not run: the conversation ends at its closing fence
    assert out.tool_calls.tolist() == [1] and out.turns.tolist() == [2]
    assert "```output\n4" not in TOK.decode(out.tokens[0, :out.lengths[0]])
    assert out.mask[0].sum() == len(TOK.encode("```calculator\n1+1\n```\n```calculator\n2+2\n```"))

    big = "```calculator\n10**40\n```\nok"
    out, _ = _run(big, max_observation_tokens=40)
    observed = out.tokens[0][out.mask[0] == 0][:int(out.lengths[0] - out.mask[0].sum())]
    note = TOK.encode("\n[observation truncated]\n```\n")
    assert len(observed) == 40 and observed[-len(note):].tolist() == note
    assert observed[:13].tolist() == TOK.encode("\n```output\n1000")  # the output's start, then the note

    out, _ = _run(big, max_new_tokens=30)  # the call fits, its output does not: cut there
    assert out.truncated[0] and out.lengths[0] <= 30 and out.tool_calls[0] == 1
    with pytest.raises(ValueError, match="max_turns"):
        _run(big, max_turns=-1)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_the_trainer_scores_the_model_tokens_as_the_sampler_drew_them(engine):
    """A real model samples conversations (each fence it writes answered by an observation), the trainer packs
    them and recomputes the log-probs of every token: on the model's tokens they equal the sampler's, and the
    observation tokens are out of the mask. On the continuous engine the conversations turn over on its slots
    (a continued one fed its tokens so far again from its prompt's cached prefill), 4 slots for 6 of them."""
    from jaxrl_llm.train.logprobs import response_logprobs
    from jaxrl_llm.train.packing import pack_groups, unpack
    from tests.tiny_models import tiny_sampler_model

    config, params = tiny_sampler_model(vocab_size=TOK.vocab_size)
    params["embed"] = params["embed"].at[FENCE_ID].multiply(4.0)  # fences often enough to call a few times

    class AnswerEveryFence:
        stop_strings = ("```",)

        def step(self, record, text, *, ended, calls_left=1):
            if ended or calls_left < 1:
                return TurnResult("end")
            return TurnResult("observe", observation="\n```output\nok\n```\n", tool_call=True)

    records = [{"prompt_ids": TOK.encode("Q: 1?")}, {"prompt_ids": TOK.encode("Q: 22?")}]
    slots = {"max_slots": 4, "segment_iterations": 5} if engine == "continuous" else {}
    out = multiturn.generate_multiturn(params, config, TOK, records, AnswerEveryFence(), num_samples=3,
                                       max_new_tokens=40, max_turns=3, rng=jax.random.key(3), engine=engine, **slots)
    observed = (out.mask == 0) & (np.arange(40) < out.lengths[:, None])
    assert out.tool_calls.sum() > 0 and observed.any()  # the test exercises observations
    groups = [np.flatnonzero(out.prompt_index == g) for g in range(2)]
    batch = pack_groups([r["prompt_ids"] for r in records], groups, out.tokens, out.lengths, masks=out.mask)
    trainer = unpack(np.asarray(response_logprobs(params, config, batch)), groups, len(out.lengths))
    on = out.mask > 0
    np.testing.assert_allclose(trainer[on], out.logprobs[on], atol=2e-4)
    assert (unpack(batch.mask, groups, len(out.lengths)) == out.mask).all()


class AnswerEveryE:
    """An environment that stops a turn at every token holding an "e" (frequent in a random policy's text) and
    answers it with a short output block."""

    stop_strings = ("e",)

    def step(self, record, text, *, ended, calls_left=1):
        if ended or calls_left < 1:
            return TurnResult("end")
        return TurnResult("observe", observation="\n```output\n7\n```\n", tool_call=True, seconds=0.01)


@pytest.mark.parametrize("algorithm,engine", [("grpo", "static"), ("gae", "continuous")])
def test_the_training_loop_runs_on_conversations(tmp_path, algorithm, engine):
    """Two steps of GRPO (conversations in rounds on the static engine) and of PPO with a critic (GAE over the
    model's tokens only; turns on the continuous engine's slots) on a tiny random policy with `tools.env` set (its
    environment answering often): the steps update on the conversations and log their tool use, and the
    evaluation logs its tool-call rate."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.run import setup
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train
    from jaxrl_llm.train.rollouts import ToolUse

    config, params, tokenizer = tiny_policy()
    overrides = TINY_RUN + [f"train.out_dir={tmp_path}", "train.steps=2", "sampling.max_new_tokens=24",
                            "tools.env=calculator", f"algorithm.advantage={algorithm}", "tools.max_turns=2",
                            f"sampling.engine={engine}", "tools.segment_iterations=4"]
    cfg = load_config(None, overrides)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(setup, "make_tool_use", lambda section, *_, **__: ToolUse(AnswerEveryE(), section))
        summary = train(cfg, policy=(config, params, tokenizer))
    assert summary["status"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tool_calls" in r]
    assert len(steps) == 2 and all(r["tool_calls"] > 0 for r in steps), steps
    # every reward is 0 here (no answer verifies); TINY_RUN's entropy term (and PPO's critic) still update
    assert all(r["updates"] >= 1 and r["skipped_update"] == 0 for r in steps)
    assert all(0 < r["tool_call_rate"] <= 1 and r["turns"] >= 1 for r in steps)
    assert any("eval_tool_call_rate" in r for r in rows)
    if algorithm == "gae":
        assert all("value_loss" in r for r in steps)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_paired_stops_end_a_row_at_its_second_pair_token(engine):
    """`generate(..., pair_stop_ids=[x])` ends each row right after the second x it samples (the random numbers
    depend on row and step only, so the tokens before are those of a run without stops); rows with fewer than two
    run to the budget."""
    from jaxrl_llm.sampling import generate
    from tests.tiny_models import tiny_sampler_model

    config, params = tiny_sampler_model(vocab_size=16)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    common = dict(num_samples=3, max_new_tokens=24, rng=jax.random.key(5), engine=engine)
    free = generate(params, config, prompts, **common)
    x = int(np.bincount(free.tokens[free.mask > 0].ravel(), minlength=16).argmax())  # the most frequent token
    paired = generate(params, config, prompts, pair_stop_ids=[x], **common)
    ends = []
    for row in range(len(free.lengths)):
        hits = np.flatnonzero(free.tokens[row] == x)
        end = int(hits[1]) + 1 if hits.size >= 2 else 24
        ends.append(end)
        assert paired.lengths[row] == end
        assert (paired.tokens[row, :end] == free.tokens[row, :end]).all()
        assert paired.finish_reason[row] == (FINISH_STOP if hits.size >= 2 else FINISH_LENGTH)
    assert any(e < 24 for e in ends)  # the pair stops some rows


def test_forced_prefixes_continue_rows_as_if_they_had_sampled_them():
    """`generate(..., forced_prefixes=)`: each row's first tokens given, then sampled on. Forcing each row's own
    first k tokens of a free run gives that run back (the random numbers depend on row and step; tokens equal,
    log-probs to float rounding: another program), the forced tokens' log-probs the model's."""
    from jaxrl_llm.sampling import generate
    from tests.tiny_models import tiny_sampler_model

    config, params = tiny_sampler_model(vocab_size=16)
    prompts = [[3, 4, 5], [6, 7]]
    common = dict(num_samples=[3, 2], max_new_tokens=20, rng=jax.random.key(7), stop_ids=[2])
    free = generate(params, config, prompts, **common)
    cut = [min(int(n) - 1, k) for n, k in zip(free.lengths, [0, 3, 7, 1, 12])]
    forced = generate(params, config, prompts, forced_prefixes=[free.tokens[r, :k].tolist() for r, k in
                                                                  enumerate(cut)], **common)
    np.testing.assert_array_equal(forced.tokens, free.tokens)
    np.testing.assert_array_equal(forced.lengths, free.lengths)
    np.testing.assert_allclose(forced.logprobs, free.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="one per row"):
        generate(params, config, prompts, forced_prefixes=[[1]], **common)
    with pytest.raises(ValueError, match="static"):
        generate(params, config, prompts, forced_prefixes=[[1]] * 5, engine="continuous", **common)


class ContinueAtEvery:
    """Stops a turn at every token holding `text` and lets the model go on, observing nothing."""

    def __init__(self, text: str):
        self.stop_strings = (text,)

    def step(self, record, text, *, ended, calls_left=1):
        return TurnResult("end" if ended else "continue")


def test_turns_on_the_slots_continue_each_sample_as_one_free_run():
    """The continuous engine's turns (`continuous.run_slots`): a conversation that stops at every x (the free run's
    most frequent character) and is given
    back with nothing observed is fed its own tokens again and samples on with the numbers of its row and
    position, so it equals the engine's free run without those stops (tokens; log-probs to float rounding,
    another program), whatever the segment length, on fewer slots than conversations."""
    from jaxrl_llm.sampling import generate
    from tests.tiny_models import tiny_sampler_model

    config, params = tiny_sampler_model(vocab_size=TOK.vocab_size)
    records = [{"prompt_ids": TOK.encode("Q: 1?")}, {"prompt_ids": TOK.encode("Q: 22?")},
               {"prompt_ids": TOK.encode("What?")}]
    common = dict(num_samples=[3, 1, 2], max_new_tokens=32, rng=jax.random.key(11), engine="continuous",
                  max_slots=4)
    free = generate(params, config, [r["prompt_ids"] for r in records], stop_ids=[EOS_ID], **common)
    drawn = free.tokens[free.mask > 0].ravel()
    x = int(np.bincount(drawn[(drawn >= 3) & (drawn != ord("`") + 3)], minlength=TOK.vocab_size).argmax())
    assert (drawn == x).sum() >= 4  # the test exercises turns
    for segment in (1, 7):
        out = multiturn.generate_multiturn(params, config, TOK, records, ContinueAtEvery(chr(x - 3)),
                                           segment_iterations=segment, **common)
        np.testing.assert_array_equal(out.tokens, free.tokens)
        np.testing.assert_array_equal(out.lengths, free.lengths)
        np.testing.assert_allclose(out.logprobs, free.logprobs, atol=1e-5)
        assert (out.mask == free.mask).all() and out.tool_calls.sum() == 0
        assert out.rounds > 4  # segments


def test_a_conversation_waiting_for_its_tool_does_not_hold_the_others():
    """On the continuous engine's slots, one conversation's tool call blocks until every other conversation has
    ended (they stop at every token and go on): it returns only because the others decode while it waits. The
    round-based engine would hold them all for it (the wait's 120 s limit would run out)."""
    import threading

    from tests.tiny_models import tiny_sampler_model

    config, params = tiny_sampler_model(vocab_size=TOK.vocab_size)
    others_done, lock = threading.Event(), threading.Lock()
    finished = []
    waited = []

    class SlowForOne:
        stop_strings = tuple(chr(c) for c in range(32, 127))  # every printable token ends a turn

        def step(self, record, text, *, ended, calls_left=1):
            if record["slow"]:
                waited.append(others_done.wait(timeout=120))
                return TurnResult("end", seconds=0.0)
            if ended:
                with lock:
                    finished.append(record["id"])
                    if len(finished) == 4:
                        others_done.set()
                return TurnResult("end")
            return TurnResult("continue")

    records = [{"prompt_ids": TOK.encode("Q: 1?"), "slow": True, "id": 0}] + [
        {"prompt_ids": TOK.encode(f"Q: {i}{i}?"), "slow": False, "id": i} for i in range(1, 5)]
    out = multiturn.generate_multiturn(params, config, TOK, records, SlowForOne(), num_samples=1,
                                       max_new_tokens=12, rng=jax.random.key(2), engine="continuous",
                                       segment_iterations=2, tool_workers=2)
    assert waited == [True] and sorted(finished) == [1, 2, 3, 4]
    assert out.lengths[0] == 1 and (out.lengths[1:] > 1).all()  # the slow one: one token, then its wait
