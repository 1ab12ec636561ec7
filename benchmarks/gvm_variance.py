"""GVM's mechanism measured directly: the error of one step's gradient estimate under each sample allocation.

    .venv/bin/python benchmarks/gvm_variance.py --toy runs/gvm_toy [--mixes toy,hard] [--prompts 32]
        [--pool 512] [--sketch 2048] [--replicates 1000] [--out benchmarks/results/gvm_variance.json]

For a fixed policy and prompt set, a reference pool of `--pool` samples per prompt is drawn at temperature 1
and, for every sample, its reward, its length, the gradient of its summed log-likelihood
grad log pi(y | x) = grad sum_t log pi(y_t | x, y_<t) over all parameters, kept as a fixed random projection
to `--sketch` dimensions (`sketch`: every coordinate gets a random sign and is added into bucket
(index mod d); E[||S v||^2] = ||v||^2 and inner products are unbiased), and the norm of its token-embedding
gradient (GVM's G, exact). Half of each prompt's pool gives the target gradients; estimators draw from the
other half (with replacement), `--replicates` times.

Targets (from the target half; m = all prompts of the mix):
  paper      (1/m) sum_i mean_{accepted j} g_j           the M-step (Algorithm 1 / Lemma 1); 0 for unsolved i
  raftpp     sum_{i,j} r_j g_j / sum_{i,j} L_j           the token-mean RAFT++ gradient (at ratio 1)
  grpo       sum_{i,j} A_j g_j / sum_{i,j} L_j           A_j = (r_j - mean_i r) / (std_i r + 1e-6), token-mean

Estimators from n_i stage-2 draws of prompt i:
  paper_lemma1      (1/m) sum_i 1/(n_i p_i) sum_{accepted j} g_j   p_i the pool's acceptance rate (Lemma 1's p)
  paper_alg1        (1/m) sum_i 1/|D_i|     sum_{accepted j} g_j   (0 for a prompt with no accepted draw)
  tokenmean_raftpp  sum_j r_j g_j / sum_j L_j                       what the default trainer optimises
  tokenmean_grpo    sum_j A_j g_j / sum_j L_j                       A_j from the n_i draws of prompt i

Allocations, all with the stage-2 budget N = m x 8:
  uniform                n_i = 8
  gvm                    stage 1: 8 draws per prompt -> p_hat, G_hat (mean embedding-gradient norm of the
                         accepted ones) -> objectives.gvm_allocate(p_hat, G_hat, N) exactly (alpha 1e-3, beta 2)
  gvm_oracle             gvm_allocate with the pool's p_i and G_i
  optimal                the integer allocation minimising the exact variance of paper_lemma1,
                         sum_i c_i / n_i with c_i = (E[||g||^2 | acc] / p_i - ||mu_i||^2) / m^2 (pool values),
                         by greedy marginal gains from n_i = 1 (exact for a separable convex objective)
  uniform_drop_unsolved  N spread evenly over the prompts with p_hat > 0 in stage 1 (filtering without weighting)
  gvm_capped             gvm with n_i <= `--cap` (default 4 x 8), the excess handed on (train.gvm.cap_counts)
  gvm_explore            gvm, but every prompt unsolved in stage 1 keeps one stage-2 sample (taken from the
                         others' shares): a guard against losing the rarely solved prompts
  gvm_history            gvm_allocate on p and G estimated from 3 x 8 earlier samples of each prompt, as earlier
                         epochs' visits would give them at no stage-1 cost (the policy held fixed)

Reported per estimator and allocation: rel_mse = E||est - target||^2 / ||target||^2 with a 95% normal
confidence interval over replicates, the mean cosine to the target (Adam is scale-free), and the part of
rel_mse that is bias, rel_bias_sq = ||mean est - target||^2 / ||target||^2 (the rest is variance). Diagnostics of
the gvm allocation: the fraction of prompts with n_i = 0, the largest n_i share, the effective number of
prompts (sum n)^2 / sum n^2, the rank correlation of stage-1 G with the pool's G over the prompts solved in
stage 1, and the simple gradient noise scale B = tr(Sigma) / ||mean||^2 of the per-sample RAFT++ gradient
r_j g_j (McCandlish et al. 2018): a step far above B samples gains little from lower variance.

Mixes: `toy` = random prompts of the toy task (benchmarks/gvm_toy_setting.py, its default 1600 fine-tuning
steps); `hard` = a weaker policy of the same setting (0.8 x the toy model's weights + 0.2 x those of an
800-step fine-tune, `--hard-toy`; it solves prompts with rates from a few % up) on prompts of which a share
`--hard-ood` has a 4-digit operand, outside the fine-tuning range (unsolvable); `smollm2` = the bundled
SmolLM2 on the demo task (expensive on CPU: small --prompts / --pool).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- prompt mixes ---------------------------------------------------------------------------------------------

def toy_records(folder: pathlib.Path, count: int, seed: int, tokenizer) -> list[dict]:
    from gvm_toy_setting import prompt_text

    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    pick = np.random.default_rng(seed).choice(len(rows), size=count, replace=False)
    return [{"prompt_ids": tokenizer.encode(prompt_text(rows[i]["question"])), "answer": rows[i]["answer"],
             "difficulty": rows[i]["difficulty"]} for i in pick]


def hard_rows(folder: pathlib.Path, count: int, seed: int, ood_fraction: float, ood: int | None = None) -> list[dict]:
    """A share `ood_fraction` of sums with a 4-digit operand (outside the fine-tuning range: unsolvable for
    these models), the rest drawn from the task's training prompts (difficulties 1-5); shuffled."""
    rng = np.random.default_rng(seed + 1)
    ood = int(round(count * ood_fraction)) if ood is None else ood
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    rows = [rows[i] for i in rng.choice(len(rows), size=count - ood, replace=False)]
    for _ in range(ood):
        da, db = (4, int(rng.integers(1, 5)))
        if rng.random() < 0.5:
            da, db = db, da
        a = int(rng.integers(10 ** (da - 1) if da > 1 else 0, 10 ** da))
        b = int(rng.integers(10 ** (db - 1) if db > 1 else 0, 10 ** db))
        rows.append({"question": f"{a}+{b}", "answer": str(a + b)[::-1], "difficulty": da + db - 1})
    return [rows[i] for i in rng.permutation(count)]


def hard_records(folder: pathlib.Path, count: int, seed: int, tokenizer, ood_fraction: float) -> list[dict]:
    from gvm_toy_setting import prompt_text

    return [{"prompt_ids": tokenizer.encode(prompt_text(r["question"])), "answer": r["answer"],
             "difficulty": r["difficulty"]} for r in hard_rows(folder, count, seed, ood_fraction)]


def write_hard_setting(args, out: pathlib.Path) -> None:
    """The hard mix as a training setting for benchmarks/gvm_study.py --toy OUT: OUT/model (the hard policy),
    OUT/train.jsonl (all of the toy's training prompts with 4-digit ones added to a share `--hard-ood`) and
    OUT/eval.jsonl (the toy's held-out prompts)."""
    import shutil

    from jaxrl_llm.run.setup import load_policy

    toy = pathlib.Path(args.toy)
    hard_model(load_policy(str(toy / "model"))[1], args)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(pathlib.Path(args.cache) / "hard_model", out / "model", dirs_exist_ok=True)
    size = sum(1 for _ in (toy / "train.jsonl").open())
    ood = int(round(size * args.hard_ood / (1 - args.hard_ood)))
    rows = hard_rows(toy, size + ood, args.seed, args.hard_ood, ood=ood)  # every toy prompt once, plus `ood`
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(toy / "eval.jsonl", out / "eval.jsonl")
    print(f"wrote {out}: model, train.jsonl ({len(rows)} prompts, {args.hard_ood:.0%} with a 4-digit operand), "
          f"eval.jsonl")


def hard_model(params, args):
    """The `hard` mix's policy: w x the toy model + (1 - w) x a less-trained one of the same setting and seed
    (`--hard-toy`, gvm_toy_setting.py --sft-steps 800, which alone solves 2% of prompts), w = `--hard-weight`.
    Written to CACHE/hard_model (an HF folder: train on it with model.source=...)."""
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.run.setup import load_policy

    folder = pathlib.Path(args.cache) / "hard_model"
    if (folder / "config.json").exists():
        return load_policy(str(folder))[1]
    model_config, weak, _ = load_policy(str(pathlib.Path(args.hard_toy) / "model"))
    params = jax.tree_util.tree_map(lambda a, b: args.hard_weight * a + (1 - args.hard_weight) * b, params, weak)
    from gvm_toy_setting import char_tokenizer

    models.save_hf(folder, model_config, params, tokenizer=char_tokenizer())
    return params


def smollm2_records(count: int, seed: int, tokenizer) -> list[dict]:
    from jaxrl_llm import data as data_lib

    records = data_lib.load_records("arithmetic")
    kept, _ = data_lib.build_prompts(records, tokenizer, "arithmetic-3shot", max_prompt_tokens=256)
    pick = np.random.default_rng(seed).choice(len(kept), size=count, replace=False)
    return [kept[i] for i in pick]


# ---- the reference pool ---------------------------------------------------------------------------------------

def sign_tree(params, seed: int):
    """Fixed random +/-1 signs shaped like the parameters (the sketch's randomness)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    signs = [jnp.where(jax.random.bernoulli(k, 0.5, leaf.shape), 1.0, -1.0).astype(jnp.float32)
             for k, leaf in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, signs)


def sketch(grads, signs, dim: int):
    """sum over leaves of fold(sign * g): coordinate k of a leaf goes, with its sign, into bucket k mod dim."""
    import jax
    import jax.numpy as jnp

    out = jnp.zeros(dim, jnp.float32)
    for g, s in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(signs)):
        flat = (g.astype(jnp.float32) * s).reshape(-1)
        flat = jnp.pad(flat, (0, -flat.size % dim))
        out = out + flat.reshape(-1, dim).sum(0)
    return out


@functools.partial(__import__("jax").jit, static_argnames=("model_config", "dim"))
def _chunk_grads(params, signs, model_config, dim, tokens, prompt_lens, response_tokens, mask):
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.train.logprobs import row_logprobs

    def row_logp(p, token_row, prompt_len, response_row, mask_row):
        logp = row_logprobs(p, model_config, token_row[None], prompt_len[None], response_row[None])[0]
        return jnp.sum(logp * mask_row)

    def one(token_row, prompt_len, response_row, mask_row):
        g = jax.grad(row_logp)(params, token_row, prompt_len, response_row, mask_row)
        embed_norm = jnp.sqrt(jnp.sum(jnp.square(g["embed"].astype(jnp.float32))))
        full_sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(g))
        return sketch(g, signs, dim), embed_norm, full_sq

    return jax.vmap(one)(tokens, prompt_lens, response_tokens, mask)


def build_pool(model_config, params, tokenizer, records, *, pool: int, max_new_tokens: int, dim: int,
               rows_per_chunk: int, seed: int, log=print) -> dict[str, np.ndarray]:
    """Sample `pool` responses per prompt at T = 1, score them, and take per-sample gradients."""
    import jax

    from jaxrl_llm.run.config import AlgorithmSection, SamplingSection
    from jaxrl_llm.train.rollouts import RewardScorer, ScoredRollouts, all_rows_batch, sample_and_score

    sampling = SamplingSection(max_new_tokens=max_new_tokens, temperature=1.0, max_rows_per_call=2048)
    scorer = RewardScorer(AlgorithmSection(), sampling, timeout=5.0, workers=0)
    t0 = time.perf_counter()
    scored = sample_and_score(params, model_config, tokenizer, records, pool, sampling, scorer,
                              jax.random.PRNGKey(seed))
    log(f"  sampled and scored {scored.num_samples} responses in {time.perf_counter() - t0:.0f}s "
        f"(accuracy {scored.correct.mean():.3f})")
    signs = sign_tree(params, seed + 7)
    n = scored.num_samples
    sketches = np.zeros((n, dim), np.float32)
    embed_norm = np.zeros(n, np.float32)
    full_sq = np.zeros(n, np.float32)
    t0 = time.perf_counter()
    for start in range(0, n, rows_per_chunk):
        rows = np.arange(start, min(start + rows_per_chunk, n))
        part = ScoredRollouts(records=scored.records, prompt_index=scored.prompt_index[rows],
                              tokens=scored.tokens[rows], mask=scored.mask[rows], logprobs=scored.logprobs[rows],
                              lengths=scored.lengths[rows], rewards=scored.rewards[rows], correct=scored.correct[rows])
        batch = all_rows_batch(part, rows_per_chunk, tokenizer.pad_token_id)
        s, e, f = _chunk_grads(params, signs, model_config, dim, batch.tokens, batch.prompt_lens,
                               batch.response_tokens, batch.mask)
        sketches[rows], embed_norm[rows], full_sq[rows] = (np.asarray(x)[:rows.size] for x in (s, e, f))
        if (start // rows_per_chunk) % max(1, 256 // rows_per_chunk) == 0:
            log(f"  gradients {start + rows.size}/{n} ({time.perf_counter() - t0:.0f}s)")
    order = np.argsort(scored.prompt_index, kind="stable")  # prompt-major [P, K]
    shape = (len(records), pool)
    return {"reward": scored.correct[order].reshape(shape).astype(np.float32),
            "length": scored.lengths[order].reshape(shape).astype(np.float32),
            "embed_norm": embed_norm[order].reshape(shape), "full_sq": full_sq[order].reshape(shape),
            "grad": sketches[order].reshape(*shape, dim)}


# ---- allocations ----------------------------------------------------------------------------------------------

def gvm_counts(p, g, budget):
    from jaxrl_llm.objectives import gvm_allocate

    return np.asarray(gvm_allocate(np.asarray(p, np.float32), np.asarray(g, np.float32), budget), np.int64)


def even_counts(keep: np.ndarray, budget: int) -> np.ndarray:
    """budget spread evenly over the prompts where keep (the first ones get the remainder)."""
    counts = np.zeros(keep.size, np.int64)
    idx = np.flatnonzero(keep)
    if idx.size:
        counts[idx] = budget // idx.size
        counts[idx[:budget % idx.size]] += 1
    return counts


def optimal_counts(c: np.ndarray, budget: int) -> np.ndarray:
    """argmin sum_i c_i / n_i over integers n_i >= 1 where c_i > 0 (0 elsewhere), sum n_i = budget: greedy on the
    marginal gain c_i / n_i - c_i / (n_i + 1), exact for this separable convex objective."""
    import heapq

    counts = (c > 0).astype(np.int64)
    heap = [(-(c[i] / 1 - c[i] / 2), i) for i in np.flatnonzero(c > 0)]
    heapq.heapify(heap)
    for _ in range(budget - int(counts.sum())):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        counts[i] += 1
        n = counts[i]
        heapq.heappush(heap, (-(c[i] / n - c[i] / (n + 1)), i))
    return counts


# ---- estimators -----------------------------------------------------------------------------------------------

def grpo_weights(r: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """GRPO advantages (r - mean_g) / (std_g + 1e-6), unbiased std; a group of one gets A = r."""
    n = np.bincount(group, minlength=num_groups).astype(np.float64)
    s1 = np.bincount(group, weights=r, minlength=num_groups)
    s2 = np.bincount(group, weights=r * r, minlength=num_groups)
    mean = s1 / np.maximum(n, 1)
    var = np.where(n > 1, (s2 - n * mean ** 2) / np.maximum(n - 1, 1), 1.0)
    std = np.sqrt(np.maximum(var, 0.0))
    mean = np.where(n > 1, mean, 0.0)
    return (r - mean[group]) / (std[group] + 1e-6)


def estimates(grad, reward, length, prompt, sample, p_true, m):
    """The four estimators from drawn samples (prompt index `prompt`, pool column `sample`) -> dict of [d]."""
    g = grad[prompt, sample]  # [n, d]
    r = reward[prompt, sample].astype(np.float64)
    num = grad.shape[0]
    n_i = np.bincount(prompt, minlength=num).astype(np.float64)
    acc_i = np.bincount(prompt, weights=r, minlength=num)
    tokens = length[prompt, sample].sum()
    w_alg1 = np.where(acc_i[prompt] > 0, r / np.maximum(acc_i[prompt], 1), 0.0) / m
    denom = n_i * p_true
    w_lemma = np.where(denom[prompt] > 0, r / np.where(denom[prompt] > 0, denom[prompt], 1.0), 0.0) / m
    w_grpo = grpo_weights(r, prompt, num) / tokens
    weights = np.stack([w_lemma, w_alg1, r / tokens, w_grpo])  # [4, n]
    out = weights.astype(np.float32) @ g
    return dict(zip(("paper_lemma1", "paper_alg1", "tokenmean_raftpp", "tokenmean_grpo"), out))


ESTIMATORS = ("paper_lemma1", "paper_alg1", "tokenmean_raftpp", "tokenmean_grpo")
ALLOCATIONS = ("uniform", "gvm", "gvm_oracle", "optimal", "uniform_drop_unsolved", "gvm_capped", "gvm_explore",
               "gvm_history")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 3:
        return float("nan")
    ra, rb = (np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(float) for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def analyse(pool: dict[str, np.ndarray], *, per_prompt: int, stage1: int, replicates: int, cap: int,
            seed: int) -> dict:
    """The estimator study on one pool (see the module docstring)."""
    from jaxrl_llm.train.gvm import allocation_weights, cap_counts

    rng = np.random.default_rng(seed)
    reward, length, embed, grad = pool["reward"], pool["length"], pool["embed_norm"], pool["grad"]
    num, size = reward.shape
    perm = np.stack([rng.permutation(size) for _ in range(num)])  # per prompt: target half | draw half
    def take(x, cols):  # [P, K, ...] -> the columns `cols` [P, k] of each prompt
        return x[np.arange(num)[:, None], cols]

    half = size // 2
    tgt_cols, draw_cols = perm[:, :half], perm[:, half:]
    m = num
    budget = num * per_prompt

    # Targets from the target half.
    r_t, l_t, g_t = take(reward, tgt_cols), take(length, tgt_cols), take(grad, tgt_cols)
    acc_t = r_t.sum(1)
    mu_acc = np.where(acc_t[:, None] > 0, (r_t[..., None] * g_t).sum(1) / np.maximum(acc_t, 1)[:, None], 0.0)
    target_paper = mu_acc.mean(0)
    target_raft = (r_t[..., None] * g_t).sum((0, 1)) / l_t.sum()
    a_t = grpo_weights(r_t.reshape(-1).astype(np.float64), np.repeat(np.arange(num), half), num).reshape(num, half)
    target_grpo = (a_t[..., None] * g_t).sum((0, 1)) / l_t.sum()
    targets = {"paper_lemma1": target_paper, "paper_alg1": target_paper, "tokenmean_raftpp": target_raft,
               "tokenmean_grpo": target_grpo}

    # Pool truths (whole pool) for the oracle and optimal allocations and Lemma 1's p.
    p_true = reward.mean(1).astype(np.float64)
    acc_all = reward.sum(1)
    g_true = np.where(acc_all > 0, (reward * embed).sum(1) / np.maximum(acc_all, 1), 0.0)
    mu_all = np.where(acc_all[:, None] > 0, (reward[..., None] * grad).sum(1) / np.maximum(acc_all, 1)[:, None], 0.0)
    sq_acc = np.where(acc_all > 0, (reward * (grad ** 2).sum(-1)).sum(1) / np.maximum(acc_all, 1), 0.0)
    c = np.where(p_true > 0, sq_acc / np.where(p_true > 0, p_true, 1.0) - (mu_all ** 2).sum(-1), 0.0)
    c = np.maximum(c, 0.0) / m ** 2
    fixed = {"uniform": np.full(num, per_prompt, np.int64), "gvm_oracle": gvm_counts(p_true, g_true, budget),
             "optimal": optimal_counts(c, budget)}

    # Noise scale of the per-sample RAFT++ gradient r_j g_j over the whole pool.
    v = (reward[..., None] * grad).reshape(-1, grad.shape[-1]).astype(np.float64)
    v_mean = v.mean(0)
    noise_scale = float(((v - v_mean) ** 2).sum(1).mean() / max((v_mean ** 2).sum(), 1e-30))

    err = {e: {a: np.zeros(replicates) for a in ALLOCATIONS} for e in ESTIMATORS}
    cos = {e: {a: np.zeros(replicates) for a in ALLOCATIONS} for e in ESTIMATORS}
    est_sum = {e: {a: np.zeros(grad.shape[-1]) for a in ALLOCATIONS} for e in ESTIMATORS}
    stats = {a: {"zero_frac": [], "max_share": [], "effective_prompts": []} for a in ALLOCATIONS}
    rank_corr = []
    tnorm = {e: float((targets[e] ** 2).sum()) for e in ESTIMATORS}
    for rep in range(replicates):
        s1 = draw_cols[np.arange(num)[:, None], rng.integers(0, size - half, size=(num, stage1))]
        r1 = reward[np.arange(num)[:, None], s1]
        e1 = embed[np.arange(num)[:, None], s1]
        p_hat = r1.mean(1)
        g_hat = np.where(r1.sum(1) > 0, (r1 * e1).sum(1) / np.maximum(r1.sum(1), 1), 0.0)
        counts = dict(fixed)
        counts["gvm"] = gvm_counts(p_hat, g_hat, budget)
        counts["uniform_drop_unsolved"] = even_counts(p_hat > 0, budget)
        w = np.where(counts["gvm"] > 0, allocation_weights(p_hat, g_hat, alpha=1e-3, beta=2.0), 0.0)
        counts["gvm_capped"] = cap_counts(counts["gvm"], w, cap)
        unsolved = p_hat == 0
        counts["gvm_explore"] = gvm_counts(p_hat, g_hat, budget - int(unsolved.sum())) + unsolved
        sh = draw_cols[np.arange(num)[:, None], rng.integers(0, size - half, size=(num, 3 * stage1))]
        rh, eh = reward[np.arange(num)[:, None], sh], embed[np.arange(num)[:, None], sh]
        counts["gvm_history"] = gvm_counts(rh.mean(1), np.where(rh.sum(1) > 0, (rh * eh).sum(1)
                                                                / np.maximum(rh.sum(1), 1), 0.0), budget)
        solved = (p_hat > 0) & (g_true > 0)
        rank_corr.append(spearman(g_hat[solved], g_true[solved]))
        for a in ALLOCATIONS:
            n = counts[a]
            total = max(int(n.sum()), 1)
            stats[a]["zero_frac"].append(float((n == 0).mean()))
            stats[a]["max_share"].append(float(n.max() / total))
            stats[a]["effective_prompts"].append(float(n.sum() ** 2 / max((n ** 2).sum(), 1)))
            prompt = np.repeat(np.arange(num), n)
            sample = draw_cols[prompt, rng.integers(0, size - half, size=prompt.size)]
            est = estimates(grad, reward, length, prompt, sample, p_true, m)
            for e in ESTIMATORS:
                est_sum[e][a] += est[e]
                diff = est[e].astype(np.float64) - targets[e]
                err[e][a][rep] = (diff ** 2).sum() / tnorm[e]
                en = np.sqrt((est[e].astype(np.float64) ** 2).sum())
                cos[e][a][rep] = float(est[e] @ targets[e] / (en * np.sqrt(tnorm[e]))) if en > 0 else 0.0

    def summary(x):
        mean, half_width = float(x.mean()), 1.96 * float(x.std(ddof=1)) / np.sqrt(x.size)
        return mean, [mean - half_width, mean + half_width]

    results = {}
    for e in ESTIMATORS:
        results[e] = {}
        for a in ALLOCATIONS:
            mean, ci = summary(err[e][a])
            bias = est_sum[e][a] / replicates - targets[e]
            results[e][a] = {"rel_mse": round(mean, 5), "ci95": [round(x, 5) for x in ci],
                             "cosine": round(float(cos[e][a].mean()), 4),
                             "rel_bias_sq": round(float((bias ** 2).sum() / tnorm[e]), 5)}
    gvm_stats = {k: round(float(np.mean(v)), 4) for k, v in stats["gvm"].items()}
    return {
        "frac_unsolved": round(float((p_true == 0).mean()), 4),
        "frac_rare": round(float(((p_true > 0) & (p_true < 0.1)).mean()), 4),
        "frac_solved_always": round(float((p_true == 1).mean()), 4),
        "accept_rate_quantiles": [round(float(q), 4) for q in np.quantile(p_true, [0.1, 0.25, 0.5, 0.75, 0.9])],
        "estimators": results,
        "diagnostics": {**gvm_stats, "g_rank_corr": round(float(np.nanmean(rank_corr)), 4),
                        "noise_scale": round(noise_scale, 1), "samples_per_step": budget},
        "allocation_stats": {a: {k: round(float(np.mean(v)), 4) for k, v in stats[a].items()} for a in ALLOCATIONS},
        "lemma1_variance_vs_uniform": {a: lemma1_variance_ratio(c, fixed[a], per_prompt)
                                       for a in ("gvm_oracle", "optimal")},
    }


def lemma1_variance_ratio(c: np.ndarray, counts: np.ndarray, per_prompt: int) -> dict:
    """The exact variance sum_i c_i / n_i of paper_lemma1 under `counts`, over the prompts it samples, relative
    to uniform's; `missed` counts the solvable prompts it gives n_i = 0 (their share of the target is lost: bias)."""
    sampled = counts > 0
    ratio = (c[sampled] / counts[sampled]).sum() / max((c / per_prompt).sum(), 1e-30)
    return {"ratio": round(float(ratio), 4), "missed": int(((c > 0) & ~sampled).sum())}


# ---- driver ---------------------------------------------------------------------------------------------------

def load_mix(name: str, args):
    from jaxrl_llm.run.setup import load_policy

    if name in ("toy", "hard"):
        folder = pathlib.Path(args.toy)
        model_config, params, tokenizer = load_policy(str(folder / "model"))
        if name == "toy":
            return model_config, params, tokenizer, toy_records(folder, args.prompts, args.seed, tokenizer), 10
        params = hard_model(params, args)
        return model_config, params, tokenizer, hard_records(folder, args.prompts, args.seed, tokenizer,
                                                             args.hard_ood), 10
    if name == "smollm2":
        model_config, params, tokenizer = load_policy("bundled")
        return model_config, params, tokenizer, smollm2_records(args.prompts, args.seed, tokenizer), 24
    raise SystemExit(f"unknown mix {name!r}")


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.2 * len(results), 7.6), squeeze=False)
    width = 0.1
    for col, res in enumerate(results):
        top, bottom = axes[0][col], axes[1][col]
        for k, a in enumerate(ALLOCATIONS):
            x = np.arange(len(ESTIMATORS)) + (k - (len(ALLOCATIONS) - 1) / 2) * width
            vals = [res["estimators"][e][a]["rel_mse"] for e in ESTIMATORS]
            half = [v - res["estimators"][e][a]["ci95"][0] for e, v in zip(ESTIMATORS, vals)]
            top.bar(x, vals, width, yerr=half, label=a, capsize=2)
            bottom.bar(x, [1 - res["estimators"][e][a]["cosine"] for e in ESTIMATORS], width, label=a)
        for ax in (top, bottom):
            ax.set_xticks(np.arange(len(ESTIMATORS)))
            ax.set_xticklabels([e.replace("_", "\n", 1) for e in ESTIMATORS], fontsize=8)
            ax.set_yscale("log")
        top.set_title(f"{res['mix']}: {res['prompts']} prompts, budget {res['budget']}, "
                      f"{res['frac_unsolved']:.0%} unsolved", fontsize=9)
        top.set_ylabel("relative MSE to the target (95% CI)")
        bottom.set_ylabel("1 - cosine to the target")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toy", default="runs/gvm_toy", help="directory written by benchmarks/gvm_toy_setting.py")
    parser.add_argument("--hard-toy", default="runs/gvm_toy_mid",
                        help="the less-trained model of the `hard` mix: gvm_toy_setting.py --sft-steps 800 --out ...")
    parser.add_argument("--hard-weight", type=float, default=0.8, help="weight of the toy model in the hard policy")
    parser.add_argument("--mixes", default="toy,hard")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--pool", type=int, default=512)
    parser.add_argument("--sketch", type=int, default=2048)
    parser.add_argument("--replicates", type=int, default=1000)
    parser.add_argument("--per-prompt", type=int, default=8, help="N'': the stage-2 budget per prompt")
    parser.add_argument("--stage1", type=int, default=8, help="N': stage-1 samples per prompt")
    parser.add_argument("--cap", type=int, default=32, help="gvm_capped's bound on n_i")
    parser.add_argument("--hard-ood", type=float, default=0.35, help="share of 4-digit-operand prompts in `hard`")
    parser.add_argument("--rows-per-chunk", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default="runs/gvm_variance", help="pools are kept here as .npz and reused")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gvm_variance.json"))
    parser.add_argument("--write-hard-setting", default=None, metavar="DIR",
                        help="only write the hard mix as a training setting for gvm_study.py --toy DIR, then exit")
    args = parser.parse_args()
    if args.write_hard_setting:
        write_hard_setting(args, pathlib.Path(args.write_hard_setting))
        return

    out = pathlib.Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {"mixes": []}
    results = {r["mix"]: r for r in previous.get("mixes", [])}
    cache = pathlib.Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    for name in args.mixes.split(","):
        started = time.perf_counter()
        pool_file = cache / f"{name}_p{args.prompts}_k{args.pool}_d{args.sketch}_s{args.seed}.npz"
        if pool_file.exists():
            pool = dict(np.load(pool_file))
            print(f"{name}: pool from {pool_file}")
        else:
            model_config, params, tokenizer, records, max_new = load_mix(name, args)
            print(f"{name}: {len(records)} prompts x {args.pool} samples, sketch {args.sketch}")
            pool = build_pool(model_config, params, tokenizer, records, pool=args.pool, max_new_tokens=max_new,
                              dim=args.sketch, rows_per_chunk=args.rows_per_chunk, seed=args.seed)
            np.savez(pool_file, **pool)
        pool_s = time.perf_counter() - started
        res = analyse(pool, per_prompt=args.per_prompt, stage1=args.stage1, replicates=args.replicates,
                      cap=args.cap, seed=args.seed)
        results[name] = {"mix": name, "prompts": int(pool["reward"].shape[0]),
                         "pool_per_prompt": int(pool["reward"].shape[1]), "budget": args.prompts * args.per_prompt,
                         "stage1_per_prompt": args.stage1, "replicates": args.replicates, "cap": args.cap,
                         "gradient": f"all parameters, sign-fold sketch to {args.sketch} dims",
                         **res, "seconds": {"pool": round(pool_s, 1),
                                            "analysis": round(time.perf_counter() - started - pool_s, 1)}}
        print(json.dumps({k: results[name][k] for k in ("mix", "frac_unsolved", "diagnostics")}))
        for e in ESTIMATORS:
            print(f"  {e:18s} " + "  ".join(f"{a}={results[name]['estimators'][e][a]['rel_mse']:.3g}"
                                              for a in ALLOCATIONS))
    ordered = [results[k] for k in ("toy", "hard", "smollm2") if k in results]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "benchmarks/gvm_variance.py", "mixes": ordered}, indent=1) + "\n")
    plot(ordered, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
