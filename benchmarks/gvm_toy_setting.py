"""The small setting of the GVM study: a character-level addition task of graded difficulty and a tiny
decoder first fine-tuned with supervised steps until its per-prompt success is mixed.

    .venv/bin/python benchmarks/gvm_toy_setting.py [--out runs/gvm_toy] [--sft-steps 1600]
        [--label-noise 0.1,0.2,0.3,0.4,0.5]

Writes OUT/model (an HF folder: config.json, model.safetensors, a character-level tokenizer),
OUT/train.jsonl (the RL prompts) and OUT/eval.jsonl (held-out prompts), and prints the fine-tuned
model's held-out greedy accuracy and temperature-1 success rate per difficulty (about 3 min on 2 cores).

Task: a+b with 1 to 3 digits per operand (difficulty = the digit counts' sum - 1, 1 to 5). Prompts use the
data preset "bare" ("27+385=") and the model answers the sum with its digits reversed, " #### 214" (the
verifier reads "####" as GSM8K's final-answer marker); least-significant digit first, each answer digit
depends only on digits already seen, which a three-layer decoder learns in minutes.

Mixed success: the fine-tuning answers carry one wrong digit with a probability that grows with difficulty
(`--label-noise`). The model learns the sums (greedy accuracy about 0.98 from difficulty 2 up) but keeps the
label noise as uncertainty, so at temperature 1 its success falls with difficulty (0.68 at 2 to 0.51 at 5)
and almost every prompt is solved sometimes: stage 1 of GVM sees acceptance rates across (0, 1), and RL has
a real signal to sharpen. (Without the noise, the same model is either nearly deterministic, where Adam's
first updates do more harm than RL's weak signal does good, or, earlier in fine-tuning, confidently wrong.)

The study then runs on it (see benchmarks/README.md for the command and the measured result):

    .venv/bin/python benchmarks/gvm_study.py --toy runs/gvm_toy --set optim.lr=2e-5 ...
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

ANSWER_MARKER = "####"
CHARS = [chr(c) for c in range(32, 127) if chr(c) != "#"] + ["\n"]


def char_tokenizer():
    """A transformers fast tokenizer over single characters plus "####" as one token."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [ANSWER_MARKER] + CHARS)}
    backend = Backend(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"####|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def make_problems(rng: np.random.Generator, count: int) -> list[dict]:
    """`count` sums a+b with the answer's digits reversed ("27+385=" -> "214"); digit counts of a and b drawn
    uniformly from 1..3 (difficulty = their sum - 1)."""
    rows = []
    for _ in range(count):
        da, db = rng.integers(1, 4, size=2)
        a = int(rng.integers(10 ** (da - 1) if da > 1 else 0, 10 ** da))
        b = int(rng.integers(10 ** (db - 1) if db > 1 else 0, 10 ** db))
        # The sum is written least-significant digit first: each answer digit then depends only on digits
        # already seen, which a three-layer decoder learns in minutes (most-significant first it does not).
        rows.append({"question": f"{a}+{b}", "answer": str(a + b)[::-1], "difficulty": int(da + db - 1)})
    return rows


def corrupt(rng: np.random.Generator, rows: list[dict], noise_by_difficulty: list[float]) -> list[dict]:
    """Copies of `rows` in which, with probability noise_by_difficulty[difficulty - 1], one digit of the answer is
    replaced by a different digit. A model fine-tuned on them is uncertain where the labels were noisy: its
    success rate at temperature 1 falls with difficulty, and the right answer stays its most likely one, which
    is what reinforcement learning can then sharpen."""
    out = []
    for row in rows:
        answer = row["answer"]
        if rng.random() < noise_by_difficulty[min(row["difficulty"], len(noise_by_difficulty)) - 1]:
            i = int(rng.integers(len(answer)))
            digit = int(rng.integers(9))
            digit += digit >= int(answer[i])  # any digit but the true one
            answer = answer[:i] + str(digit) + answer[i + 1:]
        out.append({**row, "answer": answer})
    return out


def prompt_text(question: str) -> str:
    from jaxrl_llm.data import prompt_template

    return prompt_template("bare").render(question)


def sft(model_config, params, tokenizer, problems: list[dict], steps: int, batch: int, lr: float, seed: int, log):
    """Teacher-forced cross-entropy on the answer tokens (" #### N<eos>") of random problems."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxrl_llm import models

    encoded = []
    for row in problems:
        prompt = tokenizer.encode(prompt_text(row["question"]))
        answer = tokenizer.encode(f" {ANSWER_MARKER} {row['answer']}") + [tokenizer.eos_token_id]
        encoded.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in encoded)
    tokens = np.full((len(encoded), width), tokenizer.pad_token_id, np.int32)
    weights = np.zeros((len(encoded), width), np.float32)  # 1 where the next token is an answer token
    for i, (p, a) in enumerate(encoded):
        tokens[i, :len(p) + len(a)] = p + a
        weights[i, len(p) - 1:len(p) + len(a) - 1] = 1.0
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 4), steps, lr * 0.1), weight_decay=0.01)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tok, pos, w):
        def loss_fn(p):
            logits = models.forward(p, model_config, tok, pos)
            logp = jax.nn.log_softmax(logits[:, :-1])
            nll = -jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1)[..., 0]
            return jnp.sum(nll * w[:, :-1]) / jnp.sum(w[:, :-1])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for i in range(steps):
        idx = rng.integers(0, len(encoded), size=batch)
        params, opt_state, loss = step(params, opt_state, tokens[idx], positions[idx], weights[idx])
        if i % 100 == 0 or i == steps - 1:
            log(f"sft step {i:4d}  answer-token nll {float(loss):.3f}")
    return params


def success_rates(model_config, params, tokenizer, problems: list[dict], samples: int, temperature: float):
    """Per-problem fraction of `samples` answers the verifier accepts, through the trainer's sampler."""
    import jax

    from jaxrl_llm.rewards import math_reward
    from jaxrl_llm.sampling import generate

    prompts = [tokenizer.encode(prompt_text(r["question"])) for r in problems]
    out = generate(params, model_config, prompts, num_samples=samples, max_new_tokens=10,
                   temperature=temperature, stop_ids=tokenizer.stop_ids, rng=jax.random.PRNGKey(0))
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    rates = np.zeros(len(problems))
    for i, row in enumerate(problems):
        for j in range(i * samples, (i + 1) * samples):  # rows are prompt-major
            text = tokenizer.decode([int(t) for t in tokens[j, :lengths[j]]])
            rates[i] += math_reward(text, row["answer"]) / samples
    return rates


def by_difficulty(problems: list[dict], values: np.ndarray) -> dict[int, float]:
    levels = sorted({r["difficulty"] for r in problems})
    return {lv: round(float(np.mean([v for r, v in zip(problems, values) if r["difficulty"] == lv])), 3)
            for lv in levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gvm_toy")
    parser.add_argument("--sft-steps", type=int, default=1600)
    parser.add_argument("--sft-batch", type=int, default=64)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--label-noise", default="0.1,0.2,0.3,0.4,0.5",
                        help="per difficulty 1..5: probability that a fine-tuning answer has one wrong digit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.models.tokenizer import Tokenizer

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    seen: set[str] = set()

    def fresh(count):  # problems not used by an earlier split
        rows = []
        while len(rows) < count:
            for row in make_problems(rng, count):
                if row["question"] not in seen and len(rows) < count:
                    seen.add(row["question"])
                    rows.append(row)
        return rows

    eval_rows, train_rows, sft_rows = fresh(200), fresh(2000), fresh(20000)
    for name, rows in (("eval", eval_rows), ("train", train_rows)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    hf_tokenizer = char_tokenizer()
    folder = out / "model"
    hf_tokenizer.save_pretrained(folder)
    tokenizer = Tokenizer.from_pretrained(folder)
    config = models.ModelConfig(vocab_size=len(hf_tokenizer), hidden_size=128, intermediate_size=384, num_layers=3,
                                num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                                max_position_embeddings=128, bos_token_id=None,
                                eos_token_id=tokenizer.eos_token_id)
    params = models.init_params(config, jax.random.PRNGKey(args.seed))
    started = time.perf_counter()
    noise = [float(x) for x in args.label_noise.split(",")]
    params = sft(config, params, tokenizer, corrupt(rng, sft_rows, noise), args.sft_steps, args.sft_batch, args.sft_lr, args.seed, print)
    print(f"sft took {time.perf_counter() - started:.0f}s")
    greedy = success_rates(config, params, tokenizer, eval_rows, 1, 0.0)
    print("held-out greedy accuracy by difficulty:", by_difficulty(eval_rows, greedy))
    rates = success_rates(config, params, tokenizer, eval_rows, 8, 1.0)
    print("held-out success rate at temperature 1 (8 samples) by difficulty:", by_difficulty(eval_rows, rates))
    print(f"prompts never solved {np.mean(rates == 0):.2f}, mixed {np.mean((rates > 0) & (rates < 1)):.2f}, "
          f"always solved {np.mean(rates == 1):.2f}; mean {rates.mean():.3f}")
    models.save_hf(folder, config, params, tokenizer=hf_tokenizer)
    print(f"wrote {folder}, {out / 'train.jsonl'} ({len(train_rows)}), {out / 'eval.jsonl'} ({len(eval_rows)})")


if __name__ == "__main__":
    main()
