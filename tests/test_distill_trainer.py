"""On-policy distillation in the trainer: the `distill` config section, the teacher's weights and pass, the
advantages it gives, and one update of a tiny policy towards itself and towards a distinct teacher."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.run.config import ConfigError, load_config
from jaxrl_llm.run.setup import setup_run
from jaxrl_llm.train.distill import SkippedVerifier, distill_advantages, teacher_weights
from jaxrl_llm.train.logprobs import gather_response_hidden, output_matrix
from jaxrl_llm.train.loop import collect_rollouts, per_sample_pass, update_policy
from loop_runner import TINY_RUN, tiny_policy


def test_distill_is_off_by_default_and_its_keys_are_checked():
    cfg = load_config(None, [])
    assert cfg.distill.teacher == "" and cfg.distill.reward == "none" and cfg.distill.coef == 1.0
    assert load_config(None, ["distill.teacher=policy", "distill.reward=add",
                              "algorithm.group_filter=mixed"]).distill.reward == "add"
    cases = [
        (["distill.teacher=policy", "algorithm.group_filter=mixed"], "'distill.reward' none gives every sample"),
        (["distill.teacher=policy", "algorithm.dynamic_sampling=true"], "'distill.reward' none gives every sample"),
        (["distill.teacher=policy", "sampling.allocation=gvm"], "'distill.reward' none cannot be combined with sampl"),
        (["distill.teacher=policy", "algorithm.advantage=gae"], "'distill.reward' none cannot be combined with algo"),
        (["distill.mode=greedy"], r"'distill.mode' must be one of \['sampled', 'topk'\], got 'greedy'"),
        (["distill.coef=0"], "'distill.coef' must be > 0, got 0.0"),
        (["distill.adapter=some/folder"], "'distill.adapter' applies with a distill.teacher"),
        (["distill.teacher_dtype=int8", "train.mesh=fsdp=1"], "'distill.teacher_dtype' int8"),
        (["distill.teacher_dtype=float16"], r"'distill.teacher_dtype' must be one of \['bfloat16', 'float32', 'int8'"),
        (["distill.reward=sum"], r"'distill.reward' must be one of \['add', 'none'\]"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def section(**changes):
    return load_config(None, [f"distill.{k}={v}" for k, v in changes.items()]).distill


def test_distill_advantages_alone_and_added():
    sampler = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]], np.float32)
    teacher = np.array([[-0.5, -3.0, -1.0], [-0.5, -1.5, -9.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    algo = np.array([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]], np.float32)
    alone, metrics = distill_advantages(section(teacher="policy", coef=0.5), algo, sampler, teacher, mask)
    np.testing.assert_allclose(alone, [[0.25, -0.5, 1.0], [0.0, -0.5, 0.0]], atol=1e-7)
    # reverse KL estimate: mean of sampler - teacher over the 5 tokens = (-0.5 + 1 - 2 + 0 + 1) / 5
    assert metrics["distill_reverse_kl"] == pytest.approx(-0.1)
    assert metrics["teacher_logp"] == pytest.approx((-0.5 - 3 - 1 - 0.5 - 1.5) / 5)
    added, _ = distill_advantages(section(teacher="policy", coef=0.5, reward="add"), algo, sampler, teacher, mask)
    np.testing.assert_allclose(added, [[2.25, 1.5, 3.0], [-1.0, -1.5, 0.0]], atol=1e-7)


def test_teacher_weights_check_the_vocabulary_and_cast():
    config, params, _ = tiny_policy()
    other = config.replace(vocab_size=config.vocab_size + 64)
    with pytest.raises(ConfigError, match=f"has {config.vocab_size + 64} tokens and the policy's {config.vocab_size}"):
        teacher_weights(section(teacher="teacher/dir"), config, params, load=lambda s, d: (other, params, None))
    same_config, same = teacher_weights(section(teacher="policy"), config, params, load=None)
    assert same is params and same_config is config
    seen = {}

    def load(source, dtype):
        seen.update(source=source, dtype=dtype)
        return config, params, None

    half_config, half = teacher_weights(section(teacher="teacher/dir", teacher_dtype="bfloat16"), config, params,
                                        load=load)
    assert seen == {"source": "teacher/dir", "dtype": "bfloat16"}
    assert half_config.compute_dtype == "bfloat16" and half["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half["embed"], np.float32),
                                  np.asarray(params["embed"].astype(jnp.bfloat16), np.float32))


def _saved_adapter(config, folder):
    """A PEFT adapter of rank 2 (alpha 4) on q_proj and down_proj with random B (not LoRA's zero start), saved to
    `folder`; returns its adapters."""
    from jaxrl_llm.models import lora
    from jaxrl_llm.models.peft_io import save_peft

    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    adapters = lora.init_adapters(config, spec, jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    adapters = {"layers": {k: (jnp.asarray(rng.normal(size=v.shape), jnp.float32) if k.endswith("_lora_b") else v)
                           for k, v in adapters["layers"].items()}}
    save_peft(folder, spec, adapters)
    return adapters


def test_teacher_adapter_is_merged_and_int8_quantizes_the_projections(tmp_path):
    config, params, _ = tiny_policy()
    adapters = _saved_adapter(config, tmp_path / "adapter")
    _, merged = teacher_weights(section(teacher="policy", adapter=tmp_path / "adapter"), config, params, load=None)
    for name in ("q_proj", "down_proj"):  # W + (alpha / r) A B, layer by layer, in float64
        a = np.asarray(adapters["layers"][f"{name}_lora_a"], np.float64)
        b = np.asarray(adapters["layers"][f"{name}_lora_b"], np.float64)
        want = np.asarray(params["layers"][name], np.float64) + 2.0 * np.einsum("lir,lro->lio", a, b)
        np.testing.assert_allclose(np.asarray(merged["layers"][name], np.float64), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(merged["layers"]["k_proj"]), np.asarray(params["layers"]["k_proj"]))
    with pytest.raises(ConfigError, match="'distill.adapter'"):
        teacher_weights(section(teacher="policy", adapter=tmp_path / "missing"), config, params, load=None)

    _, codes = teacher_weights(section(teacher="policy", teacher_dtype="int8"), config, params, load=None)
    weight = np.asarray(params["layers"]["up_proj"], np.float64)
    scale = np.abs(weight).max(axis=1, keepdims=True) / 127  # per layer and output channel
    assert codes["layers"]["up_proj"].dtype == jnp.int8
    np.testing.assert_allclose(np.asarray(codes["layers"]["up_proj_scale"], np.float64), scale, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(codes["layers"]["up_proj"]), np.round(weight / scale).astype(np.int8))
    np.testing.assert_array_equal(np.asarray(codes["embed"]), np.asarray(params["embed"]))  # kept as it is


def test_skipped_verifier_scores_nothing():
    correct, rewards = SkippedVerifier()(["4", "5"], ["4", "4"], np.array([1, 1]))
    assert correct.tolist() == [False, False] and rewards.tolist() == [0.0, 0.0]


DISTILL_RUN = TINY_RUN + ["train.eval_problems=0", "algorithm.entropy_coef=0.0", "sampling.prompts_per_step=4",
                          "sampling.samples_per_prompt=4", "optim.micro_batch_size=4"]


def state_log_probs(params, config, scored) -> list[np.ndarray]:
    """Per sample, the full-vocabulary log-softmax [R, V] (float64) at every state that predicts a response token
    of these samples (one unpacked row each, whatever the policy now). The rows go in one compiled call, each
    [prompt | response] padded on the right to the longest: causal attention leaves its positions as they are."""
    prompts = [list(scored.records[scored.prompt_index[row]]["prompt_ids"]) for row in range(scored.num_samples)]
    width = max(map(len, prompts)) + scored.tokens.shape[1]
    tokens = np.zeros((scored.num_samples, width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt) + scored.tokens.shape[1]] = prompt + scored.tokens[row].tolist()
    log_probs = _state_log_probs(params, config, tokens, np.array([len(p) for p in prompts], np.int32),
                                 scored.tokens.shape[1])
    return list(np.asarray(log_probs, np.float64))


@functools.partial(jax.jit, static_argnums=(1, 4))
def _state_log_probs(params, config, tokens, prompt_lens, response_len):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden = gather_response_hidden(models.hidden_states(params, config, tokens, positions), prompt_lens, response_len)
    return jax.nn.log_softmax(hidden @ output_matrix(params, config).T, axis=-1)


def exact_reverse_kl(params, teacher_params, config, scored) -> float:
    """KL(pi_S || pi_T) summed over the vocabulary at every state that predicts a sampled token, averaged over
    the tokens (the states of these samples, whatever the policy now)."""
    pairs = zip(state_log_probs(params, config, scored), state_log_probs(teacher_params, config, scored))
    kl = [np.sum(np.exp(s) * (s - t), axis=-1) for s, t in pairs]
    return float(sum(np.sum(k * m) for k, m in zip(kl, scored.mask)) / scored.mask.sum())


def test_teacher_equal_to_student_gives_zero_advantages_and_no_gradient():
    run = setup_run(load_config(None, DISTILL_RUN + ["distill.teacher=policy"]), policy=tiny_policy())
    try:
        assert isinstance(run.scorer, SkippedVerifier)
        scored, _ = collect_rollouts(run, 0)
        assert scored.mask.sum() > 20 and not scored.rewards.any()
        teacher_logp = per_sample_pass(run, run.teacher.logprob_fn, run.teacher.params, scored)
        advantages, _ = distill_advantages(run.config.distill, None, scored.logprobs, teacher_logp, scored.mask)
        assert np.abs(advantages).max() < 1e-5
        out = update_policy(run, scored, 0)
        assert abs(out["distill_reverse_kl"]) < 1e-6
        assert out["grad_norm"] < 1e-5  # measured 3.4e-7; a distinct teacher: 0.15
    finally:
        run.close()


def test_one_step_towards_a_distinct_teacher_lowers_the_reverse_kl(tmp_path):
    teacher_config, teacher_params, tokenizer = tiny_policy(seed=1)
    models.save_hf(tmp_path / "teacher", teacher_config, teacher_params, tokenizer=tokenizer)
    run = setup_run(load_config(None, DISTILL_RUN + [f"distill.teacher={tmp_path / 'teacher'}"]),
                    policy=tiny_policy())
    try:
        scored, _ = collect_rollouts(run, 0)
        before = exact_reverse_kl(run.policy_params(), run.teacher.params, run.model_config, scored)
        out = update_policy(run, scored, 0)
        after = exact_reverse_kl(run.policy_params(), run.teacher.params, run.model_config, scored)
        assert out["grad_norm"] > 1e-2
        assert after < before, (before, after)
    finally:
        run.close()


def test_lora_teacher_is_the_frozen_base_itself():
    # Under LoRA the student starts as the base (B = 0): the teacher "policy" is the base's own buffers, no copy.
    run = setup_run(load_config(None, DISTILL_RUN + ["distill.teacher=policy", "lora.rank=4"]), policy=tiny_policy())
    try:
        assert run.teacher.params is run.base_params
        scored, _ = collect_rollouts(run, 0)
        out = update_policy(run, scored, 0)
        assert abs(out["distill_reverse_kl"]) < 1e-6 and out["grad_norm"] < 1e-5
    finally:
        run.close()


def test_distillation_resumes_and_runs_with_async_rollouts(tmp_path):
    import json

    from jaxrl_llm.train.loop import train

    teacher_config, teacher_params, tokenizer = tiny_policy(seed=1)
    models.save_hf(tmp_path / "teacher", teacher_config, teacher_params, tokenizer=tokenizer)
    overrides = DISTILL_RUN + [f"distill.teacher={tmp_path / 'teacher'}", "distill.coef=0.5"]

    def logged(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "distill_reverse_kl" in r]

    # The teacher is rebuilt from the config: a finished run continues with --resume to more steps.
    sync = overrides + [f"train.out_dir={tmp_path / 'sync'}"]
    assert train(load_config(None, sync + ["train.steps=2"]), policy=tiny_policy())["status"] == "done"
    assert train(load_config(None, sync + ["train.steps=3"]), resume=True, policy=tiny_policy())["status"] == "done"
    assert [r["step"] for r in logged(tmp_path / "sync")] == [1, 2, 3]
    # Asynchronous rollouts: the teacher scores the sampler's tokens, drawn one version behind the trainer.
    run = overrides + [f"train.out_dir={tmp_path / 'async'}", "rollouts.mode=async", "train.steps=2"]
    assert train(load_config(None, run), policy=tiny_policy())["status"] == "done"
    rows = logged(tmp_path / "async")
    assert [r["step"] for r in rows] == [1, 2] and [r["staleness"] for r in rows] == [0, 1]
    assert all(r["teacher_logp"] < 0 for r in rows)


def test_memory_estimate_counts_the_teacher():
    from jaxrl_llm.capacity.memory import estimate_memory

    config = tiny_policy()[0]
    shapes = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    elements = sum(leaf.size for leaf in jax.tree_util.tree_leaves(shapes))  # one device holds every parameter
    projections = sum(leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
                      if str(path[-1].key).endswith("_proj"))
    proj_out = {path[-1].key: leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
                if str(path[-1].key).endswith("_proj")}
    scales = sum(shape[0] * shape[-1] for shape in proj_out.values())  # one f32 scale per layer and output channel

    def estimate(*overrides, **kwargs):
        return estimate_memory(load_config(None, list(overrides)), config, {"data": 1, "fsdp": 1, "tensor": 1},
                               **kwargs)

    plain = estimate()
    assert plain["teacher"] == 0
    f32 = estimate("distill.teacher=some/folder")
    assert f32["teacher"] == 4 * elements
    assert f32["peak"] - plain["peak"] == 4 * elements
    assert f32["programs"]["train_step"]["resident"] - plain["programs"]["train_step"]["resident"] == 4 * elements
    assert estimate("distill.teacher=some/folder", "distill.teacher_dtype=bfloat16")["teacher"] == 2 * elements
    int8 = estimate("distill.teacher=some/folder", "distill.teacher_dtype=int8")["teacher"]
    assert int8 == 4 * (elements - projections) + projections + 4 * scales
    assert estimate("distill.teacher=policy", "lora.rank=4")["teacher"] == 0  # the LoRA base itself
    assert estimate("distill.teacher=policy", "lora.rank=4", "distill.teacher_dtype=bfloat16")["teacher"] == 2 * elements
    bigger = config.replace(num_layers=4)
    big = sum(leaf.size for leaf in jax.tree_util.tree_leaves(
        jax.eval_shape(lambda: models.init_params(bigger, jax.random.PRNGKey(0)))))
    assert estimate("distill.teacher=some/folder", teacher_config=bigger)["teacher"] == 4 * big


# One micro-batch of one packed row: 4 prompts x 4 samples of 60 tokens, rows of L = 320 tokens (4 slots of 60 after a
# 64-token prompt), S x R = 240 scored positions; the teacher's vocabulary 32768 (4 chunks of 8192), D = 64.
PASS_RUN = ["data.max_prompt_tokens=64", "sampling.max_new_tokens=60", "sampling.samples_per_prompt=4",
            "optim.micro_batch_size=1", "sampling.prompts_per_step=4", "algorithm.kl_coef=0",
            "distill.teacher=some/folder", "distill.top_k=16"]
PASS_MODEL = models.ModelConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=2048,
                                scan_layers=True)
ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}


def test_memory_estimate_counts_the_teacher_pass_and_the_topk_fields_by_hand():
    from jaxrl_llm.capacity.memory import estimate_memory

    def estimate(*overrides, **kwargs):
        return estimate_memory(load_config(None, PASS_RUN + list(overrides)), PASS_MODEL, ONE_DEVICE,
                               platform="cpu", **kwargs)

    hidden = 320 * 64 * 4  # the decoder's output of the row, f32
    scores = 4 * 320 * 320 * (4 + 4)  # one layer's full attention (320 < attention_block_min_length 1024)
    topk = estimate("distill.mode=topk")
    # the train step's mini-batch: 4 rows x 4 slots x 60 positions x 16 ids x (int32 + f32)
    assert topk["teacher_topk"] == 4 * 4 * 60 * 16 * 8 == 122_880
    # one chunk's f32 logits and their top-16 copy, the hidden state, the running and merged top 16 (values, ids);
    # the pass's output (4 rows' ids and log-probs) replicated
    sweep = 240 * (64 * 4 + 2 * 8192 * 4 + 4 * 16 * 8)
    assert sweep > scores and topk["teacher_pass"] == hidden + sweep + 122_880 == 16_117_760
    assert topk["programs"]["teacher_pass"]["working"] == topk["teacher"] + topk["teacher_pass"]
    sampled = estimate()
    assert sampled["teacher_topk"] == 0
    # every chunk's f32 logits, the hidden state, the int32 target and two f32 statistics per position; 4 rows x 240
    # f32 log-probs out
    assert sampled["teacher_pass"] == hidden + 240 * (64 * 4 + 12 + 32768 * 4) + 4 * 240 * 4 == 31_607_360
    assert (topk["programs"]["train_step"]["working"] - sampled["programs"]["train_step"]["working"]
            == topk["train_step"] - sampled["train_step"] + 122_880)
    # A bfloat16 teacher twice as wide: its D in 2 bytes, one chunk's logits in bf16 before the f32 cast
    wide = PASS_MODEL.replace(hidden_size=128)
    bf16 = estimate("distill.teacher_dtype=bfloat16", teacher_config=wide)["teacher_pass"]
    assert bf16 == 320 * 128 * 2 + 240 * (128 * 2 + 12 + 8192 * 2 + 32768 * 4) + 4 * 240 * 4 == 35_539_520
    assert estimate("distill.teacher=")["teacher_pass"] == 0


def test_teacher_pass_estimate_matches_xla_memory_analysis():
    """The teacher's top-K pass over a micro-batch of one row (PASS_RUN) against the temporaries and outputs XLA (CPU)
    allocates for it: measured ratio 0.99 (jax 0.10.2; V 32768 sampled 1.06, V 512 sampled 1.10, V 50000 top-K on
    2-row micro-batches 1.05)."""
    from jaxrl_llm.capacity.aot import batch_shapes
    from jaxrl_llm.capacity.memory import estimate_memory
    from jaxrl_llm.run.shapes import step_shapes
    from jaxrl_llm.train.distill import make_topk_fn

    cfg = load_config(None, PASS_RUN + ["distill.mode=topk"])
    batch = batch_shapes(cfg, step_shapes(cfg, ONE_DEVICE))._replace(teacher_ids=None, teacher_topk_logp=None)
    params = jax.eval_shape(lambda: models.init_params(PASS_MODEL, jax.random.PRNGKey(0)))
    fn = make_topk_fn(cfg.distill, PASS_MODEL, micro_batch_size=cfg.optim.micro_batch_size)
    xla = fn.lower(params, batch).compile().memory_analysis()
    est = estimate_memory(cfg, PASS_MODEL, ONE_DEVICE, platform="cpu")["teacher_pass"]
    ratio = (xla.temp_size_in_bytes + xla.output_size_in_bytes) / est
    assert 0.85 <= ratio <= 1.25, (ratio, xla.temp_size_in_bytes, xla.output_size_in_bytes, est)


# --- distill.mode topk: the teacher's top-K pass and the student's top-K loss inside the train step ---

TOPK_K = 4


def teacher_topk(params, config, batch, compact: bool = False):
    """The teacher's top-K pass over vocabulary chunks of 5000 ids (9 whole ones and a shorter last one), one
    program per layout for every test here."""
    from jaxrl_llm.train.logprobs import response_topk

    global _TOPK_PASS
    if "_TOPK_PASS" not in globals():
        _TOPK_PASS = jax.jit(response_topk, static_argnums=(1, 3), static_argnames=("chunk", "compact"))
    return _TOPK_PASS(params, config, batch, TOPK_K, chunk=5000, compact=compact)


def topk_batch(seed: int = 0, groups=((0, 1), (2,), (3, 4)), micro_batch_size: int = 2):
    """A packed batch of 5 samples of 3 prompts (rows padded to 4), advantages 0, and its samples unpacked."""
    from jaxrl_llm.train.packing import pack_groups

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, 400, n).tolist() for n in (5, 3, 4)]
    lengths = np.array([4, 2, 5, 3, 5])
    responses = rng.integers(5, 400, (5, 5)).astype(np.int32)
    batch = pack_groups(prompts, [np.array(g) for g in groups], responses, lengths, row_multiple=micro_batch_size,
                        seq_multiple=8)
    return batch, prompts, responses, lengths, [p for p, g in zip(range(3), groups) for _ in g]


def unpacked_logits(params, config, prompts, responses, lengths, owners):
    """[N, R, V] full logits of each sample's response positions, one unpacked row per sample."""
    out = []
    for i, owner in enumerate(owners):
        tokens = jnp.asarray([prompts[owner] + responses[i, :lengths[i]].tolist()], jnp.int32)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        hidden = gather_response_hidden(models.hidden_states(params, config, tokens, positions),
                                        jnp.asarray([len(prompts[owner])]), responses.shape[1])
        out.append((hidden @ output_matrix(params, config).T)[0])
    return jnp.stack(out)


def with_teacher(batch, ids, logp):
    return batch._replace(teacher_ids=np.asarray(ids, np.int32), teacher_topk_logp=np.asarray(logp, np.float32))


def test_teacher_topk_pass_is_the_top_k_of_full_logits():
    from jaxrl_llm.train.packing import unpack

    config, params, _ = tiny_policy(seed=1)
    batch, prompts, responses, lengths, owners = topk_batch()
    log_probs = jax.nn.log_softmax(unpacked_logits(params, config, prompts, responses, lengths, owners), axis=-1)
    want_logp, want_ids = jax.lax.top_k(log_probs, TOPK_K)
    mask = np.arange(responses.shape[1])[None] < lengths[:, None]
    groups = [np.array(g) for g in ((0, 1), (2,), (3, 4))]
    for compact in (False, True):  # both layouts of the scored positions
        ids, logp = teacher_topk(params, config, batch, compact)
        assert ids.shape == (*batch.mask.shape, TOPK_K) and ids.dtype == jnp.int32
        ids, logp = unpack(np.asarray(ids), groups, 5), unpack(np.asarray(logp), groups, 5)
        np.testing.assert_array_equal(ids[mask], np.asarray(want_ids)[mask])
        np.testing.assert_allclose(logp[mask], np.asarray(want_logp)[mask], atol=2e-5)
        assert not ids[~mask].any() and not logp[~mask].any()


def topk_step(config, optimizer, micro_batch_size: int, coef: float = 0.5):
    from jaxrl_llm.train.step import make_train_step

    algo = load_config(None, ["algorithm.entropy_coef=0.0"]).algorithm
    return make_train_step(config, algo, optimizer, micro_batch_size=micro_batch_size, distill_coef=coef)


def test_topk_step_loss_and_gradient_equal_the_objective_on_full_logits():
    import optax

    from jaxrl_llm.objectives import topk_distill_loss
    from jaxrl_llm.run.state import init_state
    from jaxrl_llm.train.packing import unpack

    config, params, _ = tiny_policy()
    batch, prompts, responses, lengths, owners = topk_batch()
    rng = np.random.default_rng(3)
    ids = rng.integers(0, config.vocab_size, (*batch.mask.shape, TOPK_K))
    ids[..., 0] = batch.response_tokens  # the sampled token among them, as a teacher's top K often holds it
    teacher = np.log(rng.dirichlet(np.ones(TOPK_K), batch.mask.shape) * 0.8)  # top-K mass 0.8
    batch = jax.tree_util.tree_map(jnp.asarray, with_teacher(batch, ids, teacher))
    denom = np.float32(lengths.sum())

    groups = [np.array(g) for g in ((0, 1), (2,), (3, 4))]
    ids_n, teacher_n = unpack(ids.astype(np.int32), groups, 5), unpack(teacher, groups, 5)
    mask = (np.arange(responses.shape[1])[None] < lengths[:, None]).astype(np.float32)

    def by_hand(p):  # unpacked rows, full [N, R, V] logits, the objective itself
        logits = unpacked_logits(p, config, prompts, responses, lengths, owners)
        return topk_distill_loss(logits, ids_n, teacher_n, mask)

    (want, want_metrics), want_grads = jax.jit(jax.value_and_grad(by_hand, has_aux=True))(params)
    # advantages 0: the policy loss is 0 and the loss is coef x the top-K term; SGD with lr 1: the update is -grad.
    # One batch of 4 rows, then micro-batches of 2 rows (the scan, the padding micro-batch skipped)
    sgd = optax.sgd(1.0)
    results = [topk_step(config, sgd, m)(init_state(jax.tree_util.tree_map(jnp.copy, params), sgd), batch, denom)
               for m in (4, 2)]
    for state, metrics in results:
        assert float(metrics["loss"]) == pytest.approx(0.5 * float(want), rel=1e-5)
        assert float(metrics["distill_topk_loss"]) == pytest.approx(float(want), rel=1e-5)
        assert float(metrics["topk_coverage"]) == pytest.approx(float(want_metrics["topk_coverage"]), rel=1e-5)
        for old, new, ref in zip(*(jax.tree_util.tree_leaves(t) for t in (params, state.params, want_grads))):
            # atol: the f32 rounding of the parameters (|w| < 1) in old - new
            np.testing.assert_allclose(np.asarray(old) - np.asarray(new), 0.5 * np.asarray(ref), rtol=1e-3,
                                       atol=1e-7)
    assert float(results[1][1]["grad_norm"]) == pytest.approx(float(results[0][1]["grad_norm"]), rel=1e-5)


def test_topk_teacher_equal_to_student_leaves_the_renormalisation_term():
    # teacher = student: log p~_k = log p_k - log M with M = sum_k p_k (the top-K mass), so
    # loss_t = sum_k p~_k (log p_k - log M - log p_k) = -log M_t: only the renormalisation is left, and its
    # gradient moves mass into the top K. (The programs of the tests above: the pass, the step in 2 micro-batches.)
    import optax

    from jaxrl_llm.run.state import init_state

    config, params, _ = tiny_policy()
    batch, *_ = topk_batch()
    ids, logp = teacher_topk(params, config, batch)
    batch = jax.tree_util.tree_map(jnp.asarray, with_teacher(batch, ids, logp))
    on = np.asarray(batch.mask) > 0
    mass = np.exp(np.asarray(logp, np.float64)).sum(-1)
    renormalisation = float(-np.log(mass[on]).sum() / on.sum())
    sgd = optax.sgd(1.0)
    step = topk_step(config, sgd, 2)
    state, metrics = step(init_state(params, sgd), batch, np.float32(on.sum()))
    assert float(metrics["distill_topk_loss"]) == pytest.approx(renormalisation, rel=1e-5)
    assert float(metrics["loss"]) == pytest.approx(0.5 * renormalisation, rel=1e-5)
    assert float(metrics["topk_coverage"]) == pytest.approx(float(mass[on].mean()), rel=1e-5)
    assert float(metrics["grad_norm"]) > 0
    _, after = step(state, batch, np.float32(on.sum()))  # the same batch, the teacher fixed: lower, more mass
    assert float(after["distill_topk_loss"]) < renormalisation
    assert float(after["topk_coverage"]) > float(metrics["topk_coverage"])


def test_topk_distillation_in_the_loop_and_its_config_errors():
    cases = [(["distill.teacher=policy", "distill.mode=topk", "distill.top_k=0"], "'distill.top_k' must be >= 1"),
             (["distill.mode=topk"], "'distill.mode' topk applies with a distill.teacher")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    config, params, tokenizer = tiny_policy()
    big = load_config(None, ["distill.teacher=policy", "distill.mode=topk", f"distill.top_k={config.vocab_size + 1}"])
    with pytest.raises(ConfigError, match=f"'distill.top_k'={config.vocab_size + 1} must be at most the vocabulary's "
                                          f"{config.vocab_size} tokens"):
        setup_run(big, policy=(config, params, tokenizer))
    # The loop: the teacher's top 4 at every sampled token go into the step (reward none: advantages 0, the loss is
    # coef x the top-K term alone); teacher = student leaves -log(top-K mass) per token
    run = setup_run(load_config(None, DISTILL_RUN + ["distill.teacher=policy", "distill.mode=topk", "distill.top_k=4",
                                                     "distill.coef=0.5"]), policy=(config, params, tokenizer))
    try:
        scored, _ = collect_rollouts(run, 0)
        _, logp = per_sample_pass(run, run.teacher.topk_fn, run.teacher.params, scored)
        mass = np.exp(logp.astype(np.float64)).sum(-1)[scored.mask > 0]
        out = update_policy(run, scored, 0)
        assert out["updates"] == 1 and out["finite"] and out["grad_norm"] > 0
        assert out["loss"] == pytest.approx(0.5 * out["distill_topk_loss"], rel=1e-6)
        assert out["distill_topk_loss"] == pytest.approx(-np.log(mass).mean(), rel=1e-5)
        assert out["topk_coverage"] == pytest.approx(mass.mean(), rel=1e-5)
    finally:
        run.close()


# --- distill.mode topk in the loop: a distinct teacher, LoRA, --resume ---

TOPK_RUN = DISTILL_RUN + ["distill.mode=topk", f"distill.top_k={TOPK_K}", "distill.coef=0.5"]  # the loop test's


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    """An HF folder of a tiny policy of another seed: a teacher distinct from the student."""
    folder = tmp_path_factory.mktemp("distill") / "teacher"
    teacher_config, teacher_params, tokenizer = tiny_policy(seed=1)
    models.save_hf(folder, teacher_config, teacher_params, tokenizer=tokenizer)
    return folder


def measured_topk_loss(params, config, scored, ids, teacher_logp) -> float:
    """The top-K loss from the formula on full log-softmaxes in float64: p~_k = softmax of the teacher's K
    log-probs, loss_t = sum_k p~_k (log p~_k - log p_S(id_k)), averaged over the response tokens."""
    total = 0.0
    for row, student in enumerate(state_log_probs(params, config, scored)):
        t = teacher_logp[row].astype(np.float64)
        top = t.max(-1, keepdims=True)
        log_tilde = t - top - np.log(np.exp(t - top).sum(-1, keepdims=True))
        loss = np.sum(np.exp(log_tilde) * (log_tilde - np.take_along_axis(student, ids[row], axis=-1)), axis=-1)
        total += float(np.sum(loss * scored.mask[row]))
    return total / float(scored.mask.sum())


def test_topk_step_towards_a_distinct_teacher_lowers_its_loss_and_the_reverse_kl(teacher_folder):
    run = setup_run(load_config(None, TOPK_RUN + [f"distill.teacher={teacher_folder}"]), policy=tiny_policy())
    try:
        scored, _ = collect_rollouts(run, 0)
        ids, logp = per_sample_pass(run, run.teacher.topk_fn, run.teacher.params, scored)
        on = scored.mask > 0
        for row, teacher in enumerate(state_log_probs(run.teacher.params, run.model_config, scored)):
            want = np.sort(teacher, axis=-1)[:, ::-1][:, :TOPK_K]  # the teacher's own 4 largest log-probs
            np.testing.assert_allclose(logp[row][on[row]], want[on[row]], atol=2e-5)
        before = measured_topk_loss(run.policy_params(), run.model_config, scored, ids, logp)
        kl_before = exact_reverse_kl(run.policy_params(), run.teacher.params, run.model_config, scored)
        out = update_policy(run, scored, 0)
        assert out["distill_topk_loss"] == pytest.approx(before, rel=1e-4)
        assert out["loss"] == pytest.approx(0.5 * before, rel=1e-4)  # reward none: advantages 0, policy loss 0
        after = measured_topk_loss(run.policy_params(), run.model_config, scored, ids, logp)
        kl_after = exact_reverse_kl(run.policy_params(), run.teacher.params, run.model_config, scored)
        assert after < before and kl_after < kl_before, (before, after, kl_before, kl_after)
    finally:
        run.close()


def test_topk_with_lora_towards_an_adapted_base_and_towards_the_base_itself(tmp_path):
    config, params, tokenizer = tiny_policy()
    _saved_adapter(config, tmp_path / "adapter")
    lora_run = TOPK_RUN + ["lora.rank=4", "distill.teacher=policy"]
    # teacher = the base plus an adapter, student = the base with LoRA adapters (B = 0): one step moves it closer
    run = setup_run(load_config(None, lora_run + [f"distill.adapter={tmp_path / 'adapter'}"]),
                    policy=(config, params, tokenizer))
    try:
        scored, _ = collect_rollouts(run, 0)
        ids, logp = per_sample_pass(run, run.teacher.topk_fn, run.teacher.params, scored)
        before = measured_topk_loss(run.policy_params(), run.model_config, scored, ids, logp)
        out = update_policy(run, scored, 0)
        assert out["distill_topk_loss"] == pytest.approx(before, rel=1e-4) and out["grad_norm"] > 1e-3
        assert measured_topk_loss(run.policy_params(), run.model_config, scored, ids, logp) < before
    finally:
        run.close()
    # teacher = the base itself: the student's own top K, so only the renormalisation -log M_t is left (M_t its
    # top-K mass, from the full log-softmax) and the sampled tokens' reverse KL is 0
    run = setup_run(load_config(None, lora_run), policy=(config, params, tokenizer))
    try:
        scored, _ = collect_rollouts(run, 0)
        own = state_log_probs(run.policy_params(), run.model_config, scored)
        mass = np.concatenate([np.exp(np.sort(s, axis=-1)[:, -TOPK_K:]).sum(-1)[m > 0]
                               for s, m in zip(own, scored.mask)])
        out = update_policy(run, scored, 0)
        assert abs(out["distill_reverse_kl"]) < 1e-6
        assert out["distill_topk_loss"] == pytest.approx(-np.log(mass).mean(), rel=1e-4)
        assert out["topk_coverage"] == pytest.approx(mass.mean(), rel=1e-4)
    finally:
        run.close()


def test_topk_distillation_resumed_equals_the_straight_run(tmp_path, teacher_folder):
    import json

    from safetensors.numpy import load_file

    from jaxrl_llm.train.loop import train

    overrides = TOPK_RUN + [f"distill.teacher={teacher_folder}"]

    def run(out, steps, resume=False):
        cfg = load_config(None, overrides + [f"train.out_dir={out}", f"train.steps={steps}"])
        assert train(cfg, resume=resume, policy=tiny_policy())["status"] == "done"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "distill_topk_loss" in r], load_file(out / "final" / "model.safetensors")

    straight_rows, straight = run(tmp_path / "straight", 3)
    run(tmp_path / "broken", 2)
    rows, resumed = run(tmp_path / "broken", 3, resume=True)
    keys = ("step", "samples_drawn", "loss", "distill_topk_loss", "topk_coverage", "teacher_logp", "grad_norm")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in straight_rows]
    assert straight_rows[-1]["grad_norm"] > 0
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)
