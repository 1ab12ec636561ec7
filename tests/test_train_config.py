import pytest

from jaxrl_llm.run.config import ConfigError, load_config, parse_overrides


def test_defaults_and_overrides_are_typed():
    cfg = load_config(None, ["optim.lr=3e-5", "train.steps=7", "algorithm.dual_clip=3", "model.remat=true"])
    assert cfg.optim.lr == pytest.approx(3e-5)
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)
    assert cfg.model.remat is True


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rat'.*did you mean"):
        load_config(None, ["optim.learning_rat=1"])
    with pytest.raises(ConfigError, match=r"did you mean 'sampling.temperature'"):
        load_config(None, ["sampling.temprature=0.5"])


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1", r"'optim.lr' must be > 0, got -1.0"),
    ("algorithm.clip_low=1.0", r"'algorithm.clip_low' must be in \[0, 1\)"),
    ("algorithm.advantage=ppo", r"'algorithm.advantage' must be one of"),
    ("train.steps=abc", r"'train.steps' expects int, got 'abc'"),
    ("algorithm.agg=seq-mean-token-sum-norm", r"'algorithm.agg_max_len' must be set"),
    ("optim.max_row_tokens=-1", r"'optim.max_row_tokens' must be >= 0"),
])
def test_bad_values_fail_with_reason(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_yaml_preset_with_base(tmp_path):
    (tmp_path / "base.yaml").write_text("optim:\n  lr: 2.0e-5\ntrain:\n  steps: 3\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain:\n  steps: 5\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.seed=4"])
    assert (cfg.optim.lr, cfg.train.steps, cfg.train.seed) == (2e-5, 5, 4)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "flat.yaml").write_text("lr: 1\n")
    with pytest.raises(ConfigError, match="must be a section mapping"):
        load_config(tmp_path / "flat.yaml")


def test_parse_overrides_rejects_malformed():
    assert parse_overrides(["a.b=1", "c.d=x"]) == {"a.b": 1, "c.d": "x"}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["optim.lr"])


def test_runtime_model_keys_apply_to_a_policy_passed_in(tmp_path):
    """setup_run(policy=...) computes the given policy the way the run config says (remat, tiles, logit
    recomputation, compute dtype), as load_policy does for a policy it loads; the architecture is kept."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.run.setup import runtime_model_config, setup_run

    runtime = ["model.remat=true", "model.remat_policy=dots", "model.attention_block_size=64",
               "model.attention_block_min_length=128", "model.remat_logits=true", "model.compute_dtype=bfloat16", "model.moe_impl=tiles"]
    cfg = load_config(None, TINY_RUN + runtime + [f"train.out_dir={tmp_path}", "train.eval_problems=0"])
    policy = tiny_policy()
    expected = (True, "dots", 64, 128, True, "bfloat16", "tiles")
    keys = lambda c: (c.remat, c.remat_policy, c.attention_block_size, c.attention_block_min_length,  # noqa: E731
                      c.remat_logits, c.compute_dtype, c.moe_impl)
    got = runtime_model_config(policy[0], cfg.model)
    assert keys(got) == expected
    assert got.replace(remat=False, remat_policy="full", attention_block_size=None, attention_block_min_length=0,
                       remat_logits=False, compute_dtype="float32", moe_impl="auto") == policy[0]
    run = setup_run(cfg, policy=policy)
    try:
        assert keys(run.model_config) == expected
    finally:
        run.close()


def test_unbiased_m_step_needs_gvm_allocation():
    with pytest.raises(ConfigError, match="algorithm.agg.*needs sampling.allocation=gvm"):
        load_config(None, ["algorithm.agg=prompt-mean-unbiased"])
    assert load_config(None, ["algorithm.agg=prompt-mean-unbiased", "sampling.allocation=gvm"]).algorithm.agg \
        == "prompt-mean-unbiased"
    assert load_config(None, ["algorithm.agg=prompt-mean"]).algorithm.agg == "prompt-mean"


def test_allowed_values_are_built_from_the_registries():
    """config._ALLOWED restates no registry: each key's values are the registry's, and every entry loads."""
    from jaxrl_llm import objectives
    from jaxrl_llm.run import config
    from jaxrl_llm.sampling import ENGINES
    allowed = config._ALLOWED
    assert allowed[("algorithm", "advantage")] == set(objectives.ADVANTAGE_ESTIMATORS) | {"gae"}
    assert allowed[("algorithm", "loss")] == set(objectives.POLICY_LOSSES) == set(objectives.POLICY_LOSS_KINDS)
    assert allowed[("algorithm", "agg")] == set(objectives.AGG_MODES) | set(objectives.PROMPT_MEAN_MODES)
    assert allowed[("algorithm", "kl_kind")] == set(objectives.KL_KINDS)
    assert allowed[("algorithm", "rollout_correction")] == {""} | set(objectives.ROLLOUT_CORRECTION_LEVELS)
    assert allowed[("algorithm", "rollout_correction_mode")] == set(objectives.ROLLOUT_CORRECTION_MODES)
    assert allowed[("sampling", "engine")] == set(ENGINES) == {"static", "continuous"}
    assert allowed[("model", "moe_impl")] == {"auto", "ragged_dot", "tiles"}
    with pytest.raises(ConfigError, match="model.moe_impl"):
        load_config(None, ["model.moe_impl=dense"])
    for name in objectives.ADVANTAGE_ESTIMATORS:
        assert load_config(None, [f"algorithm.advantage={name}"]).algorithm.advantage == name
    for kind in objectives.POLICY_LOSSES:
        assert load_config(None, [f"algorithm.loss={kind}"]).algorithm.loss == kind


def test_every_agg_value_is_one_the_trainer_can_reduce():
    """agg: the objectives' own modes go to policy_loss; GVM's M-step modes, which policy_loss refuses (it does not
    see the prompts), are token-means over advantages the host scaled (rollouts.prompt_mean_advantages)."""
    import numpy as np

    from jaxrl_llm import objectives
    from jaxrl_llm.run import config
    logp = np.zeros((1, 2), np.float32)
    for mode in sorted(config._ALLOWED[("algorithm", "agg")]):
        cfg = load_config(None, [f"algorithm.agg={mode}", "algorithm.agg_max_len=4", "sampling.allocation=gvm"])
        if mode in objectives.PROMPT_MEAN_MODES:
            with pytest.raises(ValueError, match="prompt_mean_terms"):
                objectives.policy_loss(logp, logp, np.ones(1), np.ones((1, 2)), agg=cfg.algorithm.agg)
        else:
            objectives.policy_loss(logp, logp, np.ones(1), np.ones((1, 2)), agg=cfg.algorithm.agg, max_len=4)
    with pytest.raises(ConfigError, match=r"'algorithm.agg' must be one of \[.*'prompt-mean'.*\], got 'prompt_mean'"):
        load_config(None, ["algorithm.agg=prompt_mean"])


def test_validation_is_split_into_small_section_validators():
    """No function of config.py (nor of the policy losses) is over 100 lines; validate runs the section checks."""
    import ast
    import pathlib

    from jaxrl_llm.run import config
    root = pathlib.Path(config.__file__).parents[1]
    for path in (root / "run" / "config.py", root / "objectives" / "losses.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 100, f"{path.name}: {node.name}"
    assert len(config._CHECKS) >= 8


def test_a_resumed_run_keeps_its_schedule_of_rollouts(tmp_path):
    """resume.check_rollout_schedule: sync and async with max_staleness 0 draw alike and continue each other; any
    other change (k, to or from partial) is refused naming both schedules, before anything is restored."""
    from jaxrl_llm.run.resume import check_rollout_schedule

    def config(mode, k=0):
        lag = [f"rollouts.partial_lag={min(k, 1)}"] if mode == "partial" else []
        return load_config(None, [f"rollouts.mode={mode}", f"rollouts.max_staleness={k}", *lag])

    for now, before in ((config("sync"), config("async")), (config("async", 2), config("async", 2)),
                        (config("partial", 1), config("partial", 3))):
        check_rollout_schedule(now, before.to_dict(), tmp_path)
    check_rollout_schedule(config("sync"), {}, tmp_path)  # a checkpoint from before the section existed: sync
    for now, before in ((config("sync"), config("partial")), (config("partial"), config("sync")),
                        (config("partial", 1), config("async", 1)), (config("async", 1), config("async", 2))):
        with pytest.raises(ValueError, match=f"another schedule.*mode='{before.rollouts.mode}'.*"
                                             f"mode='{now.rollouts.mode}'"):
            check_rollout_schedule(now, before.to_dict(), tmp_path)
