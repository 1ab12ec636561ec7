"""configs/paper: every preset under configs/ loads and validates; the paper presets carry the reference
hyper-parameters (RLHFlow/GVM launch scripts), the same algorithm keys as the top-level presets, and
lengths the models accept."""

import dataclasses
import pathlib

import pytest

from jaxrl_llm.capacity.memory import model_config_for
from jaxrl_llm.train import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(CONFIGS.rglob("*.yaml"))
PAPER = sorted((CONFIGS / "paper").glob("*.yaml"))


def test_paper_presets_exist():
    assert [p.stem for p in PAPER] == [f"qwen2.5-math-{size}_{algo}" for size in ("1.5b", "7b")
                                       for algo in ("grpo", "gvm_grpo", "gvm_raftpp", "raftpp")]


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_preset_loads(path):
    load_config(path)


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_reference_hyper_parameters(path):
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip) == (1e-6, 0, 0.01, 1.0)
    assert (cfg.sampling.prompts_per_step, cfg.optim.mini_batches, cfg.optim.epochs) == (1024, 4, 1)
    assert (cfg.data.max_prompt_tokens, cfg.sampling.max_new_tokens, cfg.sampling.temperature) == (1024, 3072, 1.0)
    assert (cfg.algorithm.kl_coef, cfg.algorithm.kl_kind, cfg.algorithm.clip_low, cfg.algorithm.clip_high) == \
        (1e-3, "k3", 0.2, 0.2)
    assert (cfg.model.param_dtype, cfg.model.compute_dtype, cfg.model.remat) == ("float32", "bfloat16", True)
    assert cfg.train.out_dir == f"runs/paper/{path.stem}"
    model = model_config_for(cfg.model.source)
    assert cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens <= model.max_position_embeddings
    assert ("7b" in path.stem) == (model.hidden_size == 3584)


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_algorithm_matches_the_top_level_preset(path):
    """The paper preset's algorithm is the top-level one (configs/<algo>.yaml) with the paper's KL term."""
    algo = path.stem.split("_", 1)[1]
    paper, top = load_config(path), load_config(CONFIGS / f"{algo}.yaml")
    ignore = {"name", "kl_coef", "kl_kind"}
    for field in dataclasses.fields(paper.algorithm):
        if field.name not in ignore:
            assert getattr(paper.algorithm, field.name) == getattr(top.algorithm, field.name), field.name
    gvm_keys = [f.name for f in dataclasses.fields(paper.sampling)  # rows per chunk bounds memory only
                if f.name.startswith("gvm_") and f.name != "gvm_rows_per_chunk"] + ["allocation"]
    for key in gvm_keys:
        assert getattr(paper.sampling, key) == getattr(top.sampling, key), key
    assert paper.algorithm.name == top.algorithm.name
