"""models.attention: the fused kernels on regrouped packed rows against the XLA attention the model has always
used (values and gradients, f32), and the tiny model's train step compiled ahead of time for a TPU v5e topology
with Pallas splash attention in the program (needs libtpu, a test extra)."""

import importlib.metadata as metadata
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import attention
from jaxrl_llm.models.attention import group_width, regroup_layout, self_attention
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.train.packing import pack_groups

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"

HEADS, KV, DIM = 4, 2, 16


def _packed(seed: int, prompt_lens, group_sizes, resp_len: int):
    """A packed batch of random prompts and responses (lengths 1..resp_len) and random q, k, v for it."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 50, n) for n in prompt_lens]
    count = sum(group_sizes)
    responses = rng.integers(1, 50, (count, resp_len))
    lengths = rng.integers(1, resp_len + 1, count)
    groups, start = [], 0
    for size in group_sizes:
        groups.append(np.arange(start, start + size))
        start += size
    batch = pack_groups(prompts, groups, responses, lengths)
    rows, length = batch.tokens.shape
    q, k, v = (jnp.asarray(rng.normal(size=(rows, length, heads, DIM)), jnp.float32) for heads in (HEADS, KV, KV))
    return batch, q, k, v


def _config(impl: str, window=None, softcap=None, max_prompt=None) -> ModelConfig:
    return ModelConfig(vocab_size=50, hidden_size=HEADS * DIM, intermediate_size=8, num_layers=1, num_heads=HEADS,
                       num_kv_heads=KV, head_dim=DIM, attention_impl=impl, sliding_window=window,
                       attn_logit_softcapping=softcap, max_prompt_tokens=max_prompt)


def _compare(impl: str, batch, q, k, v, *, window=None, softcap=None, max_prompt=None):
    """Max |fused - xla| over real tokens, of the values and of the gradients of a random projection of them."""
    positions, segments = jnp.asarray(batch.positions), jnp.asarray(batch.segments)
    slots, resp_len = batch.pred_index.shape[1:]
    real = np.asarray(batch.segments) <= slots
    weights = jax.random.normal(jax.random.PRNGKey(1), (*q.shape[:2], HEADS * DIM)) * real[..., None]

    def run(config, rows_kernel=None):
        def f(q, k, v):
            if rows_kernel:  # a kernel on regrouped rows that no platform's dispatch gives on a CPU, run on it
                width = group_width(config, q.shape[1], resp_len)
                groups = regroup_layout(segments, q.shape[0], q.shape[1], slots, width)
                return attention._fused(rows_kernel, q, k, v, groups, config, window, "cpu")
            return self_attention(q, k, v, positions, config, segment_ids=segments, window=window, slots=slots,
                                  response_len=resp_len)

        values = jax.jit(f)(q, k, v)
        grads = jax.jit(jax.grad(lambda *a: (f(*a) * weights).sum(), argnums=(0, 1, 2)))(q, k, v)
        return np.asarray(values), [np.asarray(g) for g in grads]

    want, want_grads = run(_config("xla", window, softcap, max_prompt))
    if impl == "xla_rows":  # the GPU's fallback where cuDNN refuses
        got, got_grads = run(_config("xla", window, softcap, max_prompt), impl)
    else:
        got, got_grads = run(_config(impl, window, softcap, max_prompt))
    value_err = np.abs(got - want)[real].max()
    grad_err = max(np.abs(a - b).max() for a, b in zip(got_grads, want_grads))
    return value_err, grad_err


@pytest.mark.parametrize("impl", ["splash", "cudnn", "xla_rows"])
@pytest.mark.parametrize("case", [
    # prompt lengths, responses per prompt, response slots, sliding window, soft-cap
    dict(prompts=(7, 12), sizes=(3, 2), resp=9),
    dict(prompts=(5, 3, 9), sizes=(1, 4, 2), resp=6, window=5),
    dict(prompts=(11,), sizes=(2,), resp=20, softcap=5.0),
])
def test_fused_kernels_on_regrouped_rows_equal_xla_attention(impl, case):
    """Splash in interpret mode, the cuDNN call's layout through implementation="xla", and the GPU's fallback (XLA
    attention on the regrouped rows, one dense causal block per row) give the packed rows' attention of every
    prompt and response token, and its gradients, to f32 rounding: GQA (4 query heads on 2 KV heads), several
    prompt and response lengths, a sliding window, Gemma 2's soft-cap (not cuDNN's)."""
    if impl == "cudnn" and case.get("softcap"):
        pytest.skip("jax.nn.dot_product_attention takes no soft-cap (the dispatch refuses it)")
    batch, q, k, v = _packed(len(case["prompts"]), case["prompts"], case["sizes"], case["resp"])
    value_err, grad_err = _compare(impl, batch, q, k, v, window=case.get("window"), softcap=case.get("softcap"),
                                   max_prompt=max(case["prompts"]))
    assert value_err < 2e-6 and grad_err < 5e-6, (value_err, grad_err)


def test_regrouped_layout_by_hand():
    """Row [p0 p1 | a0 a1 a2 | b0 | pad]: group 0 = [p0 p1 a0 a1 a2], group 1 = [p0 p1 b0]; the packed tokens read
    their outputs back from (group 0, 0..4) and (group 1, 2); padding reads nothing."""
    segments = jnp.array([[0, 0, 1, 1, 1, 2, 3]])
    groups = regroup_layout(segments, 1, 7, 2, 6)
    np.testing.assert_array_equal(groups.real[0], [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    source = np.where(groups.real[0], groups.source[0], -1)
    np.testing.assert_array_equal(source, [[0, 1, 2, 3, 4, -1], [0, 1, 5, -1, -1, -1]])
    np.testing.assert_array_equal(groups.back_group[0, :6], [0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(groups.back_index[0, :6], [0, 1, 2, 3, 4, 2])
    np.testing.assert_array_equal(groups.back_real[0], [1, 1, 1, 1, 1, 1, 0])
    # The regrouped row width: the prompt bound + the response slots on splash's grid of 128, at most the row's.
    assert group_width(_config("splash", max_prompt=300), 4096, 100) == 512
    assert group_width(_config("splash"), 1000, 100) == 1024


@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_unpacked_rows_with_a_key_mask(impl):
    """Rows without segments (GVM's unpacked rows): one causal group per row; left-padding keys are not read, by
    splash's segments or by cuDNN's sequence lengths (the real tokens moved to the row's front)."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 10, heads, DIM)), jnp.float32) for heads in (HEADS, KV, KV))
    positions = jnp.broadcast_to(jnp.arange(10), (2, 10))
    key_mask = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10])
    want = self_attention(q, k, v, positions, _config("xla"), key_mask=key_mask)
    got = jax.jit(lambda q, k, v: self_attention(q, k, v, positions, _config(impl), key_mask=key_mask))(q, k, v)
    real = np.asarray(key_mask) != 0
    assert np.abs(np.asarray(got) - np.asarray(want))[real].max() < 2e-6


def test_auto_compiles_the_same_cpu_program_as_xla():
    """On a CPU, "auto" lowers only the XLA branch: the compiled program's instructions are those of "xla"."""
    batch, q, k, v = _packed(0, (7, 12), (3, 2), 9)
    positions, segments = jnp.asarray(batch.positions), jnp.asarray(batch.segments)

    def instructions(config):
        f = jax.jit(lambda q, k, v: self_attention(q, k, v, positions, config, segment_ids=segments, slots=4,
                                                   response_len=9))
        text = f.lower(q, k, v).compile().as_text()
        body = text.split("FileNames")[0]
        return [line.split(", metadata=")[0].split(", stack_frame_id=")[0] for line in body.splitlines()]

    assert instructions(_config("auto")) == instructions(_config("xla"))


def test_prefill_dispatch_compiles_the_same_cpu_program_as_xla_attention():
    """The sampler's prefill attention through the dispatch (cuDNN where lowered for a GPU) lowers, on a CPU, to the
    program of `layers.attention` on the causal mask: the demo's sampler is unchanged."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(3, 16, heads, DIM)), jnp.float32) for heads in (HEADS, KV, KV))
    index = jnp.arange(16)
    keep = jnp.broadcast_to(index[:, None] >= index[None, :], (3, 16, 16))
    config = _config("auto")

    def instructions(f):
        text = jax.jit(f).lower(q, k, v).compile().as_text()
        return [line.split(", metadata=")[0].split(", stack_frame_id=")[0]
                for line in text.split("FileNames")[0].splitlines() if not line.startswith("HloModule")]

    dispatched = instructions(lambda q, k, v: attention.prompt_attention(q, k, v, keep, config))
    direct = instructions(lambda q, k, v: attention.attention(q, k, v, keep, scale=config.attention_scale))
    assert dispatched == direct


def test_tiny_train_step_compiles_for_a_v5e_slice_with_splash():
    """The train step, the log-prob pass and GVM's gradient-norm pass of a tiny model compile for a v5e 2x2 slice
    (fsdp=4) with splash attention's Mosaic kernel in the programs (in a shard_map under the mesh: a Mosaic
    kernel left to the partitioner fails to lower), the sampler's prefill and decode beside them, and XLA's
    per-device memory is reported."""
    pytest.importorskip("libtpu")
    from jaxrl_llm.capacity.aot import compile_run, format_report, parse_topology
    from jaxrl_llm.run.config import load_config

    tiny = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)
    cfg = load_config(CONFIGS / "gvm_raftpp.yaml", ["sampling.max_new_tokens=32", "data.max_prompt_tokens=64",
                                                  "optim.micro_batch_size=4", "sampling.prompts_per_step=4",
                                                  "train.mesh=fsdp=4"])
    result = compile_run(cfg, "v5e:2x2", model_config=tiny)
    table = format_report(result)
    assert result["devices"] == 4 and result["hbm_bytes"] == 16 * 1024 ** 3, table
    assert result["usable_bytes"] == int(15.75 * 1024 ** 3) and "15.75 usable by a program" in table, table
    names = [program.name for program in result["programs"]]
    assert names == ["train_step", "logprob_pass", "gvm_grad_norms", "sampler_prefill", "sampler_decode"], table
    for program in result["programs"]:
        assert not program.error and program.fits, table
        assert 0 < program.peak_bytes < 1024 ** 3 and program.argument_bytes > 0, table
        # Training rows attend through splash; the sampler attends over its KV cache (XLA).
        assert program.hlo_has_splash == (program.name in ("train_step", "logprob_pass", "gvm_grad_norms")), table
    # The names users type: cores per chip on v4 / v5p, one per chip on v5e / v6e.
    assert parse_topology("v4-32").topology_name == "v4:2x2x4" and parse_topology("v4-32").chips == 16
    assert parse_topology("v4-8").topology_name == "v4:2x2x1" and parse_topology("v5p-128").topology_name == "v5p:4x4x4"
    assert parse_topology("v5litepod-64").topology_name == "v5e:8x8"
    assert parse_topology("v5litepod-8").host_bounds == (2, 4, 1)
    with pytest.raises(ValueError, match="unknown TPU topology"):
        parse_topology("v9-8")


def test_compile_command_reports_and_fails_on_a_program_over_hbm(tmp_path, capsys):
    """`jaxrl-llm compile` prints the table and writes it as JSON, exit 0 when every program fits (PPO on the
    continuous engine: its critic step and the engine's decode loop among them); a run made too large for a v5e
    chip's 16 GiB exits 1 naming the program that does not fit."""
    pytest.importorskip("libtpu")
    import json

    from jaxrl_llm import cli
    from jaxrl_llm.capacity import aot
    tiny = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)
    real = aot.compile_run
    args = ["compile", "--config", str(CONFIGS / "ppo.yaml"), "--topology", "v5e:2x2", "--json", str(tmp_path / "out.json"),
            "sampling.max_new_tokens=32", "data.max_prompt_tokens=64", "optim.micro_batch_size=4",
            "sampling.prompts_per_step=4", "sampling.engine=continuous", "sampling.max_slots=8"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aot, "compile_run", lambda cfg, topo, **kw: real(cfg, topo, model_config=tiny, **kw))
        assert cli.main(args) == 0
        assert "train_step" in capsys.readouterr().out
        saved = json.loads((tmp_path / "out.json").read_text())
        assert [p["name"] for p in saved["programs"]] == ["train_step", "logprob_pass", "critic_step",
                                                          "sampler_continuous"]
        assert all(p["fits"] and not p["error"] and p["peak_bytes"] > 0 for p in saved["programs"])
        # XLA's own peak of each program's buffers is recorded beside the sum it allots (arguments counted)
        assert all(p["argument_bytes"] <= p["compiler_peak_bytes"] for p in saved["programs"]), saved["programs"]
        # a saved result's estimates recomputed (scripts/compile_table.py --reuse): the same as compiled with
        from jaxrl_llm.train import load_config
        stale = {**saved, "estimate": {}, "programs": [{**p, "estimate_bytes": 0, "resident_bytes": 0, "fits": False}
                                                       for p in saved["programs"]]}
        fresh = aot.refresh_estimates(load_config(CONFIGS / "ppo.yaml", args[7:]), stale, model_config=tiny)
        assert fresh["programs"] == saved["programs"] and fresh["estimate"] == saved["estimate"]
        assert all(p["estimate_bytes"] > 0 for p in fresh["programs"] if p["name"] != "logprob_pass")
        # 4 layers of 3 x 4096 x 65536 f32 weights are 12.9 GB, with AdamW's two moments 38.7 GB: 9.7 GB per chip
        # of 4 before the gradients and the update's temporaries, over the chip's 16 GiB.
        huge = tiny.replace(num_layers=4, hidden_size=4096, intermediate_size=65536, num_heads=32, num_kv_heads=8,
                            head_dim=128)
        patch.setattr(aot, "compile_run", lambda cfg, topo, **kw: real(cfg, topo, model_config=huge, **kw))
        assert cli.main(args[:7] + ["--programs", "train_step"] + args[7:]) == 1  # the one program over HBM
        assert "train_step does not fit" in capsys.readouterr().err


def test_compile_puts_an_async_sampler_on_its_own_devices_with_its_own_copy():
    """With `rollouts.sampler_devices` the trainer's programs compile on the first devices and the sampler's on
    the last ones, reading the policy in `sampling.dtype` laid out by the model's rules there (as the run places
    each version); beside a sampler program stay its other versions (max_staleness = 1: one more). A slice of
    several hosts is refused, as the run refuses it."""
    pytest.importorskip("libtpu")
    from jaxrl_llm.capacity import aot
    from jaxrl_llm.run.config import ConfigError, load_config

    tiny = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)
    overrides = ["sampling.max_new_tokens=32", "data.max_prompt_tokens=64", "optim.micro_batch_size=4",
                 "sampling.prompts_per_step=4", "rollouts.mode=async", "rollouts.sampler_devices=2",
                 "sampling.dtype=bfloat16"]
    cfg = load_config(CONFIGS / "grpo.yaml", overrides)
    devices = aot.topology_devices(aot.parse_topology("v5e:2x2"))
    result = aot.compile_run(cfg, "v5e:2x2", model_config=tiny, devices=devices)
    table = aot.format_report(result)
    assert result["mesh"] == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 1} == result["sampler_mesh"], table
    assert "the sampler on its own devices, mesh {'data': 1, 'fsdp': 2, 'expert': 1, 'tensor': 1}" in table, table
    names = [p.name for p in result["programs"]]
    assert names == ["train_step", "logprob_pass", "sampler_prefill", "sampler_decode"], table
    assert all(p.fits and not p.error for p in result["programs"]), table

    full = jax.eval_shape(lambda: aot.init_params(tiny, jax.random.PRNGKey(0)))
    mesh = aot.make_mesh("", devices=devices[:2])
    sampler_mesh = aot.make_mesh("", devices=devices[2:])
    base = aot._abstract(full, aot.param_shardings(full, mesh))
    mc, weights = aot._sampler_policy(cfg, tiny, mesh, sampler_mesh, base)
    leaves = jax.tree_util.tree_leaves(weights)
    assert mc.param_dtype == mc.compute_dtype == "bfloat16" and all(x.dtype == jnp.bfloat16 for x in leaves)
    assert all(x.sharding.device_set == set(devices[2:]) for x in leaves)
    # one bf16 version per sampler device, from the shards' shapes; the other version beside the program
    version = sum(2 * np.prod(x.sharding.shard_shape(x.shape)) for x in leaves)
    assert result["estimate"]["sampler_version"] == version, result["estimate"]
    for program in result["programs"][2:]:
        assert program.resident_bytes == version, table
    with pytest.raises(ConfigError, match="one host only for now .* on 4 hosts"):
        aot.compile_run(cfg, "v4-32", model_config=tiny)  # 16 devices on 4 hosts


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_usable_hbm_is_what_the_compiler_holds_a_program_to(generation):
    """Each chip's `usable_bytes` is the installed libtpu's: a program whose buffers peak 0.1 GiB under it compiles,
    one 0.1 GiB over it is refused with that "available HBM" (the check counts the arguments and outputs: the
    program below holds nothing else). The figures are those of the newest release of `aot.USABLE_GIB_BY_LIBTPU` at
    or before the installed one: a release that holds programs to another figure fails here until it is listed."""
    pytest.importorskip("libtpu")
    from jaxrl_llm.capacity.aot import CHIPS, Topology, libtpu_release, topology_devices

    chip = CHIPS[generation]
    grid = "2x2" if generation in ("v5e", "v6e") else "2x2x1"
    device = topology_devices(Topology(generation, chip, f"{chip.generation}:{grid}", 4, chip.host_bounds))[0]
    on_chip = jax.sharding.SingleDeviceSharding(device)
    gib, width = 1024 ** 3, 2 ** 20

    def compile_with_peak(peak: int):
        # its argument (32 MiB) and its f32 output, nothing else: the peak is their sum
        rows = (peak - 32 * 1024 ** 2) // (4 * width)

        def program(a, x):
            return x + jnp.arange(rows * width, dtype=jnp.float32).reshape(rows, width) + a[:1].sum()

        args = (jax.ShapeDtypeStruct((8 * 1024 ** 2,), jnp.float32, sharding=on_chip),
                jax.ShapeDtypeStruct((), jnp.float32, sharding=on_chip))
        return jax.jit(program).lower(*args).compile()

    release = f"libtpu {metadata.version('libtpu')}, figures of {libtpu_release()}"
    under = compile_with_peak(chip.usable_bytes - gib // 10).memory_analysis()
    assert chip.usable_bytes - gib // 10 - 2 ** 20 < under.peak_memory_in_bytes <= chip.usable_bytes, (release, under)
    with pytest.raises(Exception) as refused:
        compile_with_peak(chip.usable_bytes + gib // 10)
    assert f"available HBM ({chip.usable_bytes / gib:.2f}G)" in str(refused.value), (release, str(refused.value)[:300])


def test_usable_hbm_follows_the_libtpu_release(monkeypatch):
    """The figures of a libtpu release are those of the newest measured release at or before it; without libtpu,
    the first listed (what the recorded compile results were made with)."""
    from jaxrl_llm.capacity import aot

    assert list(aot.USABLE_GIB_BY_LIBTPU)[:2] == ["0.0.42.1", "0.0.50.1"]
    assert [aot.libtpu_release(v) for v in ("0.0.30", "0.0.42.1", "0.0.49.2", "0.0.50.1", "0.0.50.1+nightly")] \
        == ["0.0.42.1", "0.0.42.1", "0.0.42.1", "0.0.50.1", "0.0.50.1"]
    assert aot.libtpu_release("9.0") == list(aot.USABLE_GIB_BY_LIBTPU)[-1]
    assert all(set(figures) == {"v4", "v5e", "v5p", "v6e"} for figures in aot.USABLE_GIB_BY_LIBTPU.values())

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert aot.libtpu_release() == "0.0.42.1"


def test_a_program_fits_by_the_compilers_peak_where_recorded():
    """`aot.place_beside`: a program fits when the run's resident arrays (the estimate's per-program split,
    `memory.program_memory`) plus XLA's own peak of its buffers (`compiler_peak_bytes`) fit the chip, though the sum
    XLA allots it (`peak_bytes`, arguments + temporaries) is larger (a 1.5B GRPO train step at 3 rows per v5e chip
    compiled with 19.3 GiB allotted, 14.2 GiB peak, on a 16 GiB chip); a report without the compiler's peak (saved
    before it was recorded) is judged by the allotment."""
    from jaxrl_llm.capacity import aot
    gib = 1024 ** 3
    est = {"programs": {"logprob_pass": {"resident": 4 * gib, "working": 0}}}
    tighter = {"programs": {"logprob_pass": {"resident": 4 * gib + gib // 2, "working": 0}}}

    def report(**kw):
        return aot.ProgramReport("logprob_pass", 1.0, gib, 0, 0, 9 * gib, 10 * gib, None, True, True, **kw)

    recorded, old = report(compiler_peak_bytes=8 * gib), report()
    aot.place_beside([recorded, old], est, 16 * gib)
    # the log-prob pass reads the policy beside AdamW's moments: 4 GiB resident; 4 + 8 fits 16, 4 + 10 too
    assert recorded.resident_bytes == 4 * gib and recorded.need_bytes == 8 * gib and recorded.fits
    assert old.need_bytes == 10 * gib and old.fits
    tight = report(compiler_peak_bytes=11 * gib)
    tight.peak_bytes = 13 * gib
    aot.place_beside([tight], tighter, 16 * gib)
    assert tight.fits  # 4.5 + 11 <= 16 < 4.5 + 13
    big = report()
    big.peak_bytes = 13 * gib
    aot.place_beside([big], tighter, 16 * gib)
    assert not big.fits
    failed = report(error="RESOURCE_EXHAUSTED")
    aot.place_beside([failed], est, 16 * gib)
    assert not failed.fits  # a program the compiler refused never fits
