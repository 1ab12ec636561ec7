"""LoRA (models/lora.py, models/peft_io.py, the train step's adapters-only update): new adapters leave the
logits unchanged, every pass of the model applies them as the merged weight W + s A B does, their gradients
are the merged weight's gradient restricted to A and B, training leaves the base bitwise unchanged, the
sampler agrees with the forward pass, the PEFT export loads in `peft` with the same logits, a sharded step
equals one device, and a LoRA run resumes bitwise after kill -9."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.models.peft_io import load_peft, save_peft

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESH = "data=2,fsdp=2,tensor=2"


def _tiny(**overrides):
    config = models.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, attention_bias=True, **overrides)
    return config, models.init_params(config, jax.random.PRNGKey(0))


def _random_adapters(config, spec, seed=1, scale=0.3):
    """Adapters with B != 0 too (new ones have B = 0, which hides a missing or wrong low-rank term)."""
    shapes = lora.adapter_shapes(config, spec)["layers"]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {"layers": {name: scale * jax.random.normal(key, shape) for key, (name, shape) in zip(keys, shapes.items())}}


def _inputs(config, batch=2, length=7, seed=0):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def test_resolve_targets_and_spec():
    assert lora.resolve_targets("all") == lora.PROJECTIONS
    assert lora.resolve_targets("v, q") == ("q_proj", "v_proj")
    assert lora.resolve_targets("mlp,o_proj") == ("o_proj", "gate_proj", "up_proj", "down_proj")
    assert lora.resolve_targets("(k|v)_proj") == ("k_proj", "v_proj")
    with pytest.raises(ValueError, match="'qq'"):
        lora.resolve_targets("q,qq")
    assert lora.LoraSpec(rank=8, alpha=16.0).scale == 2.0
    with pytest.raises(ValueError, match="rank"):
        lora.LoraSpec(rank=0, alpha=1.0)


def test_lora_config_section_and_errors():
    from jaxrl_llm.run.config import ConfigError, load_config, lora_enabled

    assert not lora_enabled(load_config(None, []))  # off by default
    cfg = load_config(None, ["lora.rank=16", "lora.targets=q,v"])
    assert lora_enabled(cfg) and cfg.lora.rank == 16 and cfg.lora.alpha == 16.0
    for override, key in (("lora.rank=-1", "lora.rank"), ("lora.alpha=0", "lora.alpha"),
                          ("lora.targets=query", "lora.targets")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])


def test_merge_hand_value():
    base = {"layers": {"q_proj": jnp.array([[[1.0, 0.0], [0.0, 1.0]]])}, "embed": jnp.ones((1,))}
    adapters = {"layers": {"q_proj_lora_a": jnp.array([[[1.0], [2.0]]]), "q_proj_lora_b": jnp.array([[[3.0, -1.0]]])}}
    merged = lora.merge(base, adapters, 0.5)  # W + 0.5 * [[3, -1], [6, -2]]
    np.testing.assert_array_equal(np.asarray(merged["layers"]["q_proj"]), [[[2.5, -0.5], [3.0, 0.0]]])
    assert merged["embed"] is base["embed"]


def test_new_adapters_give_the_base_logits():
    config, params = _tiny()
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    adapters = lora.init_adapters(config, spec, jax.random.PRNGKey(1))
    assert all(float(jnp.abs(a).max()) > 0 for k, a in adapters["layers"].items() if k.endswith("_lora_a"))
    tokens, positions = _inputs(config)
    base = models.forward(params, config, tokens, positions)
    adapted = models.forward(lora.attach(params, adapters, spec.scale), config, tokens, positions)
    assert float(jnp.abs(adapted - base).max()) <= 1e-6


@pytest.mark.parametrize("variant", [dict(), dict(scan_layers=False), dict(remat=True, remat_policy="dots"),
                                     dict(attention_block_size=4),
                                     dict(model_type="gemma3_text", qk_norm=True, sliding_window=3,
                                          rope_local_theta=1e4, layer_types=("sliding_attention", "full_attention")),
                                     dict(model_type="gemma2", sliding_window=3, attn_logit_softcapping=5.0,
                                          final_logit_softcapping=4.0, scan_layers=False)])
def test_every_forward_path_applies_the_adapters_as_the_merged_weight(variant):
    config, params = _tiny(**variant)
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    adapters = _random_adapters(config, spec)
    tokens, positions = _inputs(config)
    attached = models.forward(lora.attach(params, adapters, spec.scale), config, tokens, positions)
    merged = models.forward(lora.merge(params, adapters, spec.scale), config, tokens, positions)
    base = models.forward(params, config, tokens, positions)
    tol = 1e-5
    assert float(jnp.abs(attached - merged).max()) < tol
    assert float(jnp.abs(attached - base).max()) > 0.1  # the adapters move the logits
    # The KV-cache path (prefill then one token at a time) too.
    cache = models.init_cache(config, tokens.shape[0], 16)
    adapted = lora.attach(params, adapters, spec.scale)
    logits, cache = models.forward_cached(adapted, config, tokens[:, :4], positions[:, :4], cache)
    steps = [logits]
    for t in range(4, tokens.shape[1]):
        out, cache = models.forward_cached(adapted, config, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        steps.append(out)
    assert float(jnp.abs(jnp.concatenate(steps, axis=1) - attached).max()) < tol


def test_adapter_gradients_are_the_merged_weight_gradient_restricted_to_a_and_b():
    """With W' = W + s A B: dL/dA = s G B^T and dL/dB = s A^T G, where G = dL/dW' (per layer)."""
    config, params = _tiny()
    spec = lora.LoraSpec(rank=3, alpha=6.0, targets=("q_proj", "o_proj", "down_proj"))
    adapters = _random_adapters(config, spec)
    tokens, positions = _inputs(config)
    weights = jax.random.normal(jax.random.PRNGKey(5), (*tokens.shape, config.vocab_size))

    def loss(p):
        return jnp.sum(jax.nn.log_softmax(models.forward(p, config, tokens, positions)) * weights)

    # Compiled (op by op, every primitive of the two backward passes would compile apart).
    got = jax.jit(jax.grad(lambda a: loss(lora.attach(params, a, spec.scale))))(adapters)["layers"]
    merged_grad = jax.jit(jax.grad(loss))(lora.merge(params, adapters, spec.scale))["layers"]
    s = spec.scale
    for name in spec.targets:
        a, b, g = adapters["layers"][f"{name}_lora_a"], adapters["layers"][f"{name}_lora_b"], merged_grad[name]
        want_a = s * jnp.einsum("lio,lro->lir", g, b)
        want_b = s * jnp.einsum("lir,lio->lro", a, g)
        for key, want in ((f"{name}_lora_a", want_a), (f"{name}_lora_b", want_b)):
            np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want), rtol=1e-4,
                                       atol=1e-4 * float(jnp.abs(want).max()), err_msg=key)
            assert float(jnp.abs(want).max()) > 1e-3, key


def _packed_batch(config, seed=0):
    from jaxrl_llm.train.packing import pack_groups

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, config.vocab_size, size=rng.integers(2, 6)).tolist() for _ in range(4)]
    responses = rng.integers(1, config.vocab_size, size=(8, 5)).astype(np.int32)
    lengths = rng.integers(2, 6, size=8)
    mask = (np.arange(5)[None] < lengths[:, None]).astype(np.float32)
    adv = rng.choice([-1.0, 1.0], size=(8, 1)).astype(np.float32) * mask
    members = [np.arange(2 * g, 2 * g + 2) for g in range(4)]
    return pack_groups(prompts, members, responses, lengths, advantages=adv, old_logp=-2.0 * mask,
                       ref_logp=-2.0 * mask, row_multiple=2), float(mask.sum())


def test_train_step_updates_the_adapters_only_and_leaves_the_base_bitwise():
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.step import make_train_step

    config, params = _tiny()
    before = jax.tree_util.tree_map(np.array, params)
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    adapters = lora.init_adapters(config, spec, jax.random.PRNGKey(1))
    optimizer = make_optimizer(OptimSection(lr=1e-2))
    algo = AlgorithmSection(kl_coef=0.1, entropy_coef=0.01)
    batch, denom = _packed_batch(config)
    state = init_state(adapters, optimizer)
    # Optimizer state for the adapters alone: Adam's moments have the adapters' structure.
    adam = state.opt_state[1][0]
    assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(adapters)
    step = make_train_step(config, algo, optimizer, micro_batch_size=2, frozen=params, lora_scale=spec.scale)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch, np.float32(denom))
        losses.append(float(metrics["loss"]))
        assert metrics["finite"] == 1.0 and metrics["grad_norm"] > 0
    assert int(state.step) == 3 and losses[1] != losses[0]
    for name, value in state.params["layers"].items():
        if name.endswith("_lora_b"):
            assert float(jnp.abs(value).max()) > 0, name  # every B moved off zero
    for path, value in jax.tree_util.tree_leaves_with_path(params):  # the base: read, never written
        np.testing.assert_array_equal(np.asarray(value), _get(before, path), err_msg=jax.tree_util.keystr(path))


def _get(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_first_lora_loss_equals_the_base_loss():
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.step import make_train_step

    config, params = _tiny()
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    optimizer = make_optimizer(OptimSection(lr=1e-2))
    algo = AlgorithmSection(kl_coef=0.1, entropy_coef=0.01)
    batch, denom = _packed_batch(config)
    full_step = make_train_step(config, algo, optimizer, micro_batch_size=2)
    _, full = full_step(init_state(jax.tree_util.tree_map(jnp.copy, params), optimizer), batch, np.float32(denom))
    lora_step = make_train_step(config, algo, optimizer, micro_batch_size=2, frozen=params, lora_scale=spec.scale)
    _, ours = lora_step(init_state(lora.init_adapters(config, spec, jax.random.PRNGKey(1)), optimizer), batch,
                        np.float32(denom))
    for key in ("loss", "policy_loss", "kl", "entropy"):
        assert abs(float(full[key]) - float(ours[key])) <= 1e-6 * max(1.0, abs(float(full[key]))), key


def test_sampler_with_adapters_matches_the_forward_pass():
    from jaxrl_llm.sampling import generate

    config = models.ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512)
    params = models.init_params(config, jax.random.PRNGKey(0))
    params["embed"] = params["embed"] * 3.0
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    adapted = lora.attach(params, _random_adapters(config, spec, scale=0.5), spec.scale)
    prompts = [[1, 2, 3], list(range(4, 15)), [9]]
    out = generate(adapted, config, prompts, num_samples=[2, 2, 1], max_new_tokens=8, temperature=1.0,
                   rng=jax.random.key(3))
    # Teacher-forced log-probs of the sampled tokens under the adapted forward pass.
    seqs = [prompts[p] + out.tokens[r, :out.lengths[r]].tolist() for r, p in enumerate(out.prompt_index)]
    width = max(map(len, seqs))
    tokens = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    logp = jax.nn.log_softmax(models.forward(adapted, config, jnp.asarray(tokens),
                                             jnp.broadcast_to(jnp.arange(width), tokens.shape)), -1)
    want = np.zeros_like(out.logprobs)
    for r, p in enumerate(out.prompt_index):
        for t in range(out.lengths[r]):
            want[r, t] = logp[r, len(prompts[p]) - 1 + t, out.tokens[r, t]]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-5)
    # Sampling from the merged weights (what the trainer does) draws the same tokens.
    merged = generate(lora.merge(params, _random_adapters(config, spec, scale=0.5), spec.scale), config, prompts,
                      num_samples=[2, 2, 1], max_new_tokens=8, temperature=1.0, rng=jax.random.key(3))
    # W + s A B and x W + s (x A) B round differently (log-probs to 1e-5); the draws use the same keys, and one moves
    # only if the rounding puts it within ~1e-5 of a CDF boundary (24 tokens, 40 draws).
    np.testing.assert_array_equal(merged.tokens, out.tokens)
    np.testing.assert_allclose(merged.logprobs, out.logprobs, atol=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_export_loads_in_peft_with_the_same_logits(family, tiny_checkpoint, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from tiny_models import load_torch_model, torch_logits

    path = tiny_checkpoint(family)
    config, params = models.load_hf(path)
    spec = lora.LoraSpec(rank=4, alpha=12.0, targets=lora.resolve_targets("q,k,v,o,gate,up,down"))
    adapters = _random_adapters(config, spec, scale=0.1)
    save_peft(tmp_path / "adapter", spec, adapters, base_model=str(path))
    config_json = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config_json["r"] == 4 and config_json["lora_alpha"] == 12.0
    tokens, positions = _inputs(config, length=9)
    ours = np.asarray(models.forward(lora.attach(params, adapters, spec.scale), config, tokens, positions))
    model = peft.PeftModel.from_pretrained(load_torch_model(path), str(tmp_path / "adapter")).eval()
    theirs = torch_logits(model, tokens)
    base = torch_logits(load_torch_model(path), tokens)
    assert np.abs(theirs - base).max() > 1e-2  # the adapter is live in peft
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # The merged export loads in transformers with the same logits; the adapter reads back exactly.
    models.save_hf(tmp_path / "merged", config, lora.merge(params, adapters, spec.scale))
    np.testing.assert_allclose(torch_logits(load_torch_model(tmp_path / "merged"), tokens), theirs, atol=1e-4)
    spec_back, back = load_peft(tmp_path / "adapter", config)
    assert spec_back == spec
    for name, value in adapters["layers"].items():
        np.testing.assert_array_equal(np.asarray(back["layers"][name]), np.asarray(value), err_msg=name)
    del torch


def test_load_peft_names_the_missing_tensor(tmp_path):
    config, _ = _tiny()
    spec = lora.LoraSpec(rank=2, alpha=2.0, targets=("q_proj",))
    save_peft(tmp_path, spec, _random_adapters(config, spec))
    bigger = lora.LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "v_proj"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2.0, "target_modules": list(bigger.targets)}))
    with pytest.raises(ValueError, match="layers.0.self_attn.v_proj.lora_A"):
        load_peft(tmp_path, config)


def test_run_continues_from_a_peft_adapter_folder(tmp_path):
    from jaxrl_llm.run.config import ConfigError, load_config
    from jaxrl_llm.run.setup import lora_adapters

    config, _ = _tiny()
    spec = lora.LoraSpec(rank=2, alpha=3.0, targets=("k_proj", "up_proj"))
    adapters = _random_adapters(config, spec)
    save_peft(tmp_path, spec, adapters)
    got_spec, got = lora_adapters(load_config(None, [f"lora.adapter={tmp_path}"]), config)
    assert got_spec == spec
    for name, value in adapters["layers"].items():
        np.testing.assert_array_equal(np.asarray(got["layers"][name]), np.asarray(value), err_msg=name)
    with pytest.raises(ConfigError, match="lora.rank"):
        lora_adapters(load_config(None, [f"lora.adapter={tmp_path}", "lora.rank=8"]), config)
    with pytest.raises(ConfigError, match="lora.adapter"):
        lora_adapters(load_config(None, [f"lora.adapter={tmp_path / 'missing'}"]), config)


def test_memory_estimate_counts_adapters_not_base_gradients():
    from jaxrl_llm.capacity.memory import estimate_memory
    from jaxrl_llm.run.config import load_config

    config, _ = _tiny()
    full = estimate_memory(load_config(None, ["algorithm.kl_coef=0.01"]), config, "", devices=1)
    low = estimate_memory(load_config(None, ["algorithm.kl_coef=0.01", "lora.rank=4", "lora.targets=q,v"]), config,
                          "", devices=1)
    # q: [2, 32, 4] + [2, 4, 32], v: [2, 32, 4] + [2, 4, 16] -> 896 f32 adapter elements.
    # gradients: the f32 accumulator and one micro-batch gradient, plus two f32 update temporaries
    assert low["optimizer"] == 2 * 896 * 4 and low["gradients"] == 2 * 896 * 4 + 2 * 896 * 4 and low["reference"] == 0
    assert low["params"] == full["params"] + 896 * 4
    assert low["sampling"] == full["sampling"] + full["params"]  # the merged copy the sampler reads


# ---- runs in subprocesses: the 8-device mesh and kill -9 ---------------------------------------------------

def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **extra)


def test_sharded_lora_step_equals_single_device():
    proc = subprocess.run([sys.executable, __file__, "mesh"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert r["devices"] == 8
    # Adam amplifies float noise where |g| ~ eps; a gradient of the wrong sign would move an entry by 2 lr = 2e-2.
    assert r["adapter_diff"] < 1e-4 and r["adapter_moved"] > 1e-2, r
    for name, diff in r["metric_rel_diff"].items():
        assert diff < 1e-5, (name, r)
    assert r["base_unchanged"], r
    assert r["specs"]["q_proj_lora_a"] == "P(None, 'fsdp', None)", r
    assert r["specs"]["q_proj_lora_b"] == "P(None, None, 'tensor')", r
    assert r["specs"]["down_proj_lora_b"] == "P(None, None, 'fsdp')", r


def _mesh_checks() -> dict:
    from jaxrl_llm.models.sharding import make_mesh, param_shardings
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.layout import batch_shardings, place
    from jaxrl_llm.run.state import init_state, make_optimizer, state_shardings
    from jaxrl_llm.train.step import make_train_step

    config = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8)
    params = models.init_params(config, jax.random.PRNGKey(0))
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    adapters = _random_adapters(config, spec, scale=0.1)
    batch, denom = _packed_batch(config)
    batch = jax.tree_util.tree_map(lambda x: np.concatenate([x, x]), batch)  # 8 rows: 2 micro-batches of 4
    optimizer = make_optimizer(OptimSection(lr=1e-2))
    algo = AlgorithmSection(kl_coef=0.1, entropy_coef=0.01)
    mesh = make_mesh(MESH)

    def run(sharded):
        state = init_state(jax.tree_util.tree_map(jnp.array, adapters), optimizer)
        base_sharding = param_shardings(params, mesh) if sharded else None
        s_sharding = state_shardings(state, optimizer, param_shardings(adapters, mesh)) if sharded else None
        b_sharding = batch_shardings(mesh) if sharded else None
        base = place(params, base_sharding)
        step = make_train_step(config, algo, optimizer, micro_batch_size=4, state_sharding=s_sharding,
                               batch_sharding=b_sharding, frozen=base, frozen_sharding=base_sharding,
                               lora_scale=spec.scale)
        state, placed, history = place(state, s_sharding), place(batch, b_sharding), []
        for _ in range(2):
            state, metrics = step(state, placed, np.float32(2 * denom))
            history.append({k: float(v) for k, v in metrics.items()})
        unchanged = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                        zip(jax.tree_util.tree_leaves(base), jax.tree_util.tree_leaves(params)))
        return state, history, unchanged

    single, h_single, _ = run(False)
    sharded, h_mesh, unchanged = run(True)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
               zip(jax.tree_util.tree_leaves(single.params), jax.tree_util.tree_leaves(sharded.params)))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                zip(jax.tree_util.tree_leaves(single.params), jax.tree_util.tree_leaves(adapters)))
    metric_diff = {k: max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-8) for x, y in zip(h_single, h_mesh))
                   for k in ("loss", "policy_loss", "kl", "entropy", "grad_norm")}
    specs = {k: repr(v.sharding.spec) for k, v in sharded.params["layers"].items()}
    return {"devices": jax.device_count(), "adapter_diff": diff, "adapter_moved": moved,
            "metric_rel_diff": metric_diff, "base_unchanged": unchanged, "specs": specs}


@pytest.mark.slow
def test_lora_kill9_then_resume_is_bitwise_equal_to_uninterrupted(tmp_path):
    import time

    from safetensors.numpy import load_file

    runner = [sys.executable, str(ROOT / "tests" / "loop_runner.py"), "lora.rank=4", "algorithm.kl_coef=0.01"]

    def run(out, *extra):
        proc = subprocess.run(runner + [f"train.out_dir={out}", *extra], capture_output=True, text=True, cwd=ROOT,
                              timeout=900, env=_env())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert "STATUS done" in run(straight).stdout
    proc = subprocess.Popen(runner + [f"train.out_dir={broken}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT, env=_env())
    metrics = broken / "metrics.jsonl"
    start = time.time()
    while not (metrics.exists() and sum('"accuracy"' in l for l in metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() - start < 600, "the run ended or hung before step 2"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert "resumed from step" in run(broken, "--resume").stdout
    for folder, file in (("final", "model.safetensors"), ("final_adapter", "adapter_model.safetensors")):
        want, got = load_file(straight / folder / file), load_file(broken / folder / file)
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    adapter = load_file(straight / "final_adapter" / "adapter_model.safetensors")
    assert max(np.abs(v).max() for k, v in adapter.items() if "lora_B" in k) > 0  # the adapters trained
    # A checkpoint holds the adapters and their optimizer state only: far smaller than the model.
    checkpoint = max((straight / "checkpoints").iterdir(), key=lambda p: p.name if p.name.isdigit() else "")
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    assert size < (straight / "final" / "model.safetensors").stat().st_size / 4


if __name__ == "__main__":
    print("RESULT", json.dumps({"mesh": _mesh_checks}[sys.argv[1]]()), flush=True)


def test_resume_with_other_lora_settings_names_the_keys(tmp_path):
    """The checkpoint's JSON record is read alone, and a changed rank names the key instead of failing in orbax."""
    import jax.numpy as jnp

    from jaxrl_llm.run.checkpoint import Checkpointer
    from jaxrl_llm.run.config import load_config
    from jaxrl_llm.run.resume import check_state_layout

    saved_config = load_config(None, ["lora.rank=16"])
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(3, {"w": jnp.ones(2)}, {"config": saved_config.to_dict()})
    saved = checkpointer.read_extra()["config"]
    checkpointer.close()
    check_state_layout(load_config(None, ["lora.rank=16", "lora.alpha=8"]), saved, tmp_path)  # alpha: no layout
    with pytest.raises(ValueError, match=r"lora\.rank: checkpoint 16, this run 8"):
        check_state_layout(load_config(None, ["lora.rank=8"]), saved, tmp_path)
    with pytest.raises(ValueError, match=r"lora\.rank: checkpoint 16, this run 0.*lora\.targets"):
        check_state_layout(load_config(None, ["lora.targets=q,v"]), saved, tmp_path)
