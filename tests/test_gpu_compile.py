"""`jaxrl-llm compile` for NVIDIA GPU hosts on a machine without a GPU (the gpu-compile extra's CUDA plugin), and the
statistics each compiled program's optimized HLO gives (`capacity.hlo_stats`): kernels launched, conditionals, matmul
FLOPs with loop trip counts multiplied in, the attention kernel, against the model's FLOPs."""

import json
import pathlib

import pytest

from jaxrl_llm.capacity import aot, report
from jaxrl_llm.capacity.gpu_targets import GPUS, cuda_plugin_installed, parse_gpu_topology
from jaxrl_llm.capacity.hlo_stats import attended_pairs, model_flops, program_stats
from jaxrl_llm.models.config import ModelConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32)
needs_plugin = pytest.mark.skipif(not cuda_plugin_installed(),
                                  reason="the CUDA plugin is not installed: pip install 'jaxrl_llm[gpu-compile]'")


def test_gpu_topology_names():
    """`h200-8`: 8 GPUs of one host; `h100-8x2`: two hosts, get_topology_desc's one slice of 2 hosts x 8 GPUs."""
    one = aot.parse_topology("h200-1")
    assert (one.platform, one.topology_name, one.chips, one.chip.generation) == ("cuda", "1x1x1", 1, "h200")
    assert aot.parse_topology("h200-8").topology_name == "1x1x8" and aot.parse_topology("a100-8").chips == 8
    two = aot.parse_topology("h100-8x2")
    assert (two.topology_name, two.chips, two.host_bounds) == ("1x2x8", 16, (1, 1, 8))
    assert aot.parse_topology("v5e:2x2").platform == "tpu" and parse_gpu_topology("v5e:2x2") is None
    for name, message in (("h100-9", "1 to 8 GPUs"), ("h100-4x2", "full hosts of 8"), ("h300-8", "unknown GPU"),
                          ("h100-0", "1 to 8 GPUs")):
        with pytest.raises(ValueError, match=message):
            aot.parse_topology(name)
    # memory as CUDA reports each card; a program may use the 0.76 XLA's GPU compiler rematerializes toward
    assert GPUS["h200"].hbm_bytes == 150754820096 and "device_memory_size: 150754820096" in GPUS["h200"].target_config
    assert GPUS["a100"].hbm_bytes == 80 * 1024 ** 3 and "major: 8" in GPUS["a100"].target_config
    assert GPUS["h100"].usable_bytes == int(0.76 * 84929347584)


# A while loop run 5 times: an unfused add, a fusion holding a batched dot [4,8,16] x [4,16,32] (2*4*8*32*16 =
# 32,768 FLOPs), a cuBLAS GEMM [64,128] x [128,32] (2*64*32*128 = 524,288) and a conditional of 2 or 1 kernels; the
# loop's condition (1 kernel) runs 6 times; before it a copy and a dot [2,3] x [3,4] (48 FLOPs).
LOOP_HLO = """HloModule jit_loop, entry_computation_layout={(f32[4,8,16]{2,1,0})->f32[4,8,16]{2,1,0}}

%fused_dot (p0: f32[4,8,16], p1: f32[4,16,32]) -> f32[4,8,32] {
  %p0 = f32[4,8,16]{2,1,0} parameter(0)
  %p1 = f32[4,16,32]{2,1,0} parameter(1)
  ROOT %d = f32[4,8,32]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%branch_big (b: f32[4,8,16]) -> f32[4,8,16] {
  %b = f32[4,8,16]{2,1,0} parameter(0)
  %n = f32[4,8,16]{2,1,0} negate(%b)
  ROOT %e = f32[4,8,16]{2,1,0} exponential(%n)
}

%branch_small (s: f32[4,8,16]) -> f32[4,8,16] {
  %s = f32[4,8,16]{2,1,0} parameter(0)
  ROOT %c = f32[4,8,16]{2,1,0} copy(%s)
}

%body (arg: (s32[], f32[4,8,16], f32[4,16,32], f32[64,128], f32[128,32])) -> (s32[], f32[4,8,16], f32[4,16,32], f32[64,128], f32[128,32]) {
  %arg = (s32[], f32[4,8,16]{2,1,0}, f32[4,16,32]{2,1,0}, f32[64,128]{1,0}, f32[128,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4,8,16]{2,1,0} get-tuple-element(%arg), index=1
  %w = f32[4,16,32]{2,1,0} get-tuple-element(%arg), index=2
  %a = f32[64,128]{1,0} get-tuple-element(%arg), index=3
  %bm = f32[128,32]{1,0} get-tuple-element(%arg), index=4
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[4,8,32]{2,1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %g = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(%a, %bm), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %pick = s32[] constant(0)
  %x2 = f32[4,8,16]{2,1,0} conditional(%pick, %x, %x), branch_computations={%branch_big, %branch_small}
  ROOT %out = (s32[], f32[4,8,16]{2,1,0}, f32[4,16,32]{2,1,0}, f32[64,128]{1,0}, f32[128,32]{1,0}) tuple(%next, %x2, %w, %a, %bm)
}

%cond (carry: (s32[], f32[4,8,16], f32[4,16,32], f32[64,128], f32[128,32])) -> pred[] {
  %carry = (s32[], f32[4,8,16]{2,1,0}, f32[4,16,32]{2,1,0}, f32[64,128]{1,0}, f32[128,32]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%carry), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%k, %five), direction=LT
}

ENTRY %main (x0: f32[4,8,16], w0: f32[4,16,32], a0: f32[64,128], b0: f32[128,32], l: f32[2,3], r: f32[3,4]) -> f32[4,8,16] {
  %x0 = f32[4,8,16]{2,1,0} parameter(0)
  %w0 = f32[4,16,32]{2,1,0} parameter(1)
  %a0 = f32[64,128]{1,0} parameter(2)
  %b0 = f32[128,32]{1,0} parameter(3)
  %l = f32[2,3]{1,0} parameter(4)
  %r = f32[3,4]{1,0} parameter(5)
  %small = f32[2,4]{1,0} dot(%l, %r), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %zero = s32[] constant(0)
  %xc = f32[4,8,16]{2,1,0} copy(%x0)
  %init = (s32[], f32[4,8,16]{2,1,0}, f32[4,16,32]{2,1,0}, f32[64,128]{1,0}, f32[128,32]{1,0}) tuple(%zero, %xc, %w0, %a0, %b0)
  %loop = (s32[], f32[4,8,16]{2,1,0}, f32[4,16,32]{2,1,0}, f32[64,128]{1,0}, f32[128,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %res = f32[4,8,16]{2,1,0} get-tuple-element(%loop), index=1
}
"""


def test_hlo_stats_of_a_loop_by_hand():
    """Kernels: the entry's dot and copy (2) + 5 x (add, fusion, GEMM, the larger branch's 2) + 6 x the condition's
    compare = 33; conditionals 5; matmul FLOPs 48 + 5 x (32,768 + 524,288) = 2,785,328; the largest result
    f32[64,32] (2,048 elements; parameters, tuples and loop carries are not new buffers)."""
    stats = program_stats(LOOP_HLO)
    assert (stats.kernels, stats.conditionals, stats.matmul_flops) == (33, 5, 2_785_328)
    assert (stats.attention_kernel, stats.largest_buffer, stats.unknown_trip_loops) == ("xla", "f32[64,32]", ())
    # a loop whose trip count XLA does not know runs once here, and is named
    unknown = program_stats(LOOP_HLO.replace('"known_trip_count":{"n":"5"},', ""))
    assert (unknown.kernels, unknown.conditionals, unknown.matmul_flops) == (2 + 5 + 2, 1, 48 + 32_768 + 524_288)
    assert unknown.unknown_trip_loops == ("loop",)
    # the attention kernel by the custom calls present
    fmha = LOOP_HLO.replace('"__cublas$gemm"', '"__cudnn$fmhaSoftmax"')
    assert program_stats(fmha).attention_kernel == "cudnn"
    splash = LOOP_HLO.replace('"__cublas$gemm"', '"tpu_custom_call"').replace("%g =", "%splash_mha_fwd =")
    assert program_stats(splash).attention_kernel == "splash"


def test_model_flops_by_hand():
    """One row of a 2-token prompt and 2 responses of 3 tokens: 8 tokens, 6 scored; pairs 3 + 2 x (6 + 6) = 27. A
    1-layer model of hidden 4, 2 heads x 2, 1 KV head, MLP 8, vocabulary 10: matrices 2*4*4 + 2*4*2 + 3*4*8 = 144;
    forward 2*144*8 + 2*10*4*6 + 4*1*2*2*27 = 2304 + 480 + 432 = 3216, training 3 x that. Qwen2.5-1.5B on 2 of
    the paper's packed rows (prompt 1024, 8 x 3072): 536.81 TF."""
    assert attended_pairs(2, 2, 3) == 27 and attended_pairs(1024, 8, 3072) == 63_451_648
    mc = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=2)
    work = dict(rows=1, prompt_tokens=2, samples=2, response_tokens=3)
    assert model_flops(mc, **work, backward=False) == 3216 and model_flops(mc, **work) == 3 * 3216
    qwen = ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                       num_kv_heads=2, head_dim=128)
    paper = model_flops(qwen, rows=2, prompt_tokens=1024, samples=8, response_tokens=3072)
    assert round(paper / 1e12, 2) == 536.81


@needs_plugin
def test_cudnn_attention_is_read_from_the_compiled_program():
    """jax's cuDNN attention, compiled for an H200 here: the program calls `__cudnn$fmhaSoftmax` and its backward,
    whose FLOPs count the causal half: forward 4 B H T T d / 2, backward 2.5 times that."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    device = aot.topology_devices(aot.parse_topology("h200-1"))
    replicated = NamedSharding(Mesh(device, ("x",)), P())
    b, t, h, d = 2, 512, 4, 64

    def loss(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()

    qkv = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=replicated)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qkv, qkv, qkv).compile()
    stats = program_stats(compiled.as_text())
    assert stats.attention_kernel == "cudnn" and stats.conditionals == 0
    assert stats.matmul_flops == 3.5 * 4 * b * h * t * t * d / 2


@needs_plugin
def test_tiny_train_step_compiles_for_one_h200_through_the_command(tmp_path, capsys):
    """`jaxrl-llm compile --topology h200-1` with `train.mesh=fsdp=1` on a tiny model: the table, the JSON with each
    program's kernels, attention kernel and matmul FLOPs, every program fitting, exit 0. The train step's matmul
    FLOPs are 1 to 2.5 times the model's: full remat runs the forward twice (the model counts it once), and XLA
    attention scores every (query, key) pair of the packed row where the model counts the causal pairs of each
    [prompt | response] (4.5 x on these short rows of 64 + 8 x 32 tokens)."""
    from jaxrl_llm import cli

    real = aot.compile_run
    args = ["compile", "--config", str(CONFIGS / "grpo.yaml"), "--topology", "h200-1", "--json",
            str(tmp_path / "out.json"),
            "sampling.max_new_tokens=32", "data.max_prompt_tokens=64", "optim.micro_batch_size=2",
            "sampling.prompts_per_step=2", "train.mesh=fsdp=1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aot, "compile_run", lambda cfg, topo, **kw: real(cfg, topo, model_config=TINY, **kw))
        assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "h200-1 (1x1x1, 1 devices, 140.40 GiB HBM each, 106.71 usable by a program)" in table, table
    saved = json.loads((tmp_path / "out.json").read_text())
    programs = {p["name"]: p for p in saved["programs"]}
    assert list(programs) == ["train_step", "logprob_pass", "sampler_prefill", "sampler_decode"], table
    for p in programs.values():
        assert p["fits"] and not p["error"] and p["kernels"] > 0 and p["attention_kernel"] == "xla", p
        assert 0 < p["compiler_peak_bytes"] < 1024 ** 3, p
    step, logprob = programs["train_step"], programs["logprob_pass"]
    # 2 rows of a 64-token prompt and 8 responses of 32: the model's forward is 490.7 MFLOP, training 3 x that
    assert step["model_flops"] == model_flops(TINY, rows=2, prompt_tokens=64, samples=8, response_tokens=32)
    assert logprob["model_flops"] == step["model_flops"] / 3
    assert 1.0 <= step["matmul_flops"] / step["model_flops"] <= 2.5, table
    assert 1.0 <= logprob["matmul_flops"] / logprob["model_flops"] <= 2.0, table
    # a result saved before these fields existed is still read (their defaults)
    old = {**saved, "programs": [{k: v for k, v in p.items() if k not in ("kernels", "attention_kernel",
                                                                        "matmul_flops", "model_flops",
                                                                        "conditionals", "largest_buffer")}
                                 for p in saved["programs"]]}
    from jaxrl_llm.train import load_config
    fresh = aot.refresh_estimates(load_config(CONFIGS / "grpo.yaml", args[7:]), old, model_config=TINY)
    assert [p["fits"] for p in fresh["programs"]] == [True] * 4 and fresh["programs"][0]["kernels"] == 0
    assert "train_step" in aot.format_report({**fresh, "programs": [aot.ProgramReport(**p)
                                                                    for p in fresh["programs"]]})


def test_compile_without_the_cuda_plugin_exits_2_with_the_install_line(capsys):
    """Without the gpu-compile extra, compiling for GPU hosts stops before any work: exit 2, the install line."""
    from jaxrl_llm import cli
    from jaxrl_llm.capacity import gpu_targets
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu_targets, "cuda_plugin_installed", lambda: False)
        assert cli.main(["compile", "--config", str(CONFIGS / "grpo.yaml"), "--topology", "h100-8"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'jaxrl_llm[gpu-compile]'" in err and "bash scripts/setup.sh gpu-compile" in err, err


@needs_plugin
def test_tiny_run_compiles_over_two_h100_hosts():
    """`h100-8x2`: 16 GPUs on two hosts, the run's mesh `fsdp=16` over all of them; each program's matmul FLOPs and
    the model's are per GPU (the 16 rows split one a GPU), the same ratio as on one GPU with 2 rows."""
    from jaxrl_llm.run.config import load_config

    cfg = load_config(CONFIGS / "grpo.yaml", ["sampling.max_new_tokens=32", "data.max_prompt_tokens=64",
                                             "optim.micro_batch_size=16", "sampling.prompts_per_step=16",
                                             "train.mesh=fsdp=16"])
    result = aot.compile_run(cfg, "h100-8x2", model_config=TINY)
    table = aot.format_report(result)
    assert result["devices"] == 16 and result["topology_desc"] == "1x2x8" and result["mesh"]["fsdp"] == 16, table
    assert all(p.fits and p.kernels > 0 for p in result["programs"]), table
    step = result["programs"][0]
    assert step.model_flops == model_flops(TINY, rows=16, prompt_tokens=64, samples=8, response_tokens=32) / 16
    assert 1.0 <= step.matmul_flops / step.model_flops <= 2.5, table


@needs_plugin
def test_paper_train_step_on_one_h200_runs_cudnn_attention_in_few_kernels():
    """The 1.5B GRPO paper preset's train step (28 layers, f32 weights, bf16 compute, full remat, attention tiles of
    512 for the xla path) on 2 of the paper's packed rows (a 1024-token prompt + 8 x 3072), one row per
    micro-batch, compiled for one H200 with the default `model.attention_impl=auto`: cuDNN's fused attention on the
    regrouped rows, at most 20,000 kernels (the packed xla path's tile loop: ~13.85 million on this shape), no
    conditional per tile, matmul FLOPs at most 1.5 x the model's, and no buffer with two dimensions as long as the
    packed row (no [T, T] scores)."""
    import re

    from jaxrl_llm.capacity.memory import KNOWN_MODELS
    from jaxrl_llm.run.config import load_config

    cfg = load_config(CONFIGS / "paper" / "qwen2.5-math-1.5b_grpo.yaml",
                      ["train.mesh=fsdp=1", "optim.micro_batch_size=1", "sampling.prompts_per_step=2",
                       "optim.mini_batches=1"])
    texts = []
    with pytest.MonkeyPatch.context() as patch:  # the compiled program's text, as `report.program_report` reads it
        patch.setattr(report, "program_stats", lambda text: (texts.append(text), program_stats(text))[1])
        result = aot.compile_run(cfg, "h200-1", model_config=KNOWN_MODELS["qwen2.5-math-1.5b"], only=("train_step",))
    (step,) = result["programs"]
    table = aot.format_report(result)
    assert (result["rows"], result["row_length"]) == (2, 28672), table
    assert step.fits and step.attention_kernel == "cudnn", table
    assert step.kernels <= 20_000 and step.conditionals < 10, table
    assert step.model_flops == model_flops(KNOWN_MODELS["qwen2.5-math-1.5b"], rows=2, prompt_tokens=1024, samples=8,
                                           response_tokens=3072)
    assert step.matmul_flops / step.model_flops <= 1.5, table
    shapes = {m.group(0) for m in re.finditer(r"\b[a-z][a-z0-9]*\[[0-9,]+\]", texts[0])}
    long = [s for s in shapes if sum(int(n) >= 28672 for n in s.split("[")[1][:-1].split(",")) >= 2]
    assert not long, long


# A fusion reading one layer of stacked weights f32[4,8,16] (a dynamic-slice: 8*16*4 = 512 bytes read, not 2,048)
# and writing one row into a cache f32[4,16] in place (dynamic-update-slice: 64 bytes written, the cache not read),
# then a conditional under the attention tile scope whose expensive branch is 2 kernels, its cheap one 1.
FUSION_HLO = """HloModule jit_fusion

%fused_slice (w: f32[4,8,16], i: s32[], c: f32[4,16], r: f32[1,16]) -> (f32[8,16], f32[4,16]) {
  %w = f32[4,8,16]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %c = f32[4,16]{1,0} parameter(2)
  %r = f32[1,16]{1,0} parameter(3)
  %z = s32[] constant(0)
  %s = f32[1,8,16]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,8,16}
  %b = f32[8,16]{1,0} bitcast(%s)
  %u = f32[4,16]{1,0} dynamic-update-slice(%c, %r, %i, %z)
  ROOT %t = (f32[8,16]{1,0}, f32[4,16]{1,0}) tuple(%b, %u)
}

%expensive (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %n = f32[8,16]{1,0} negate(%a)
  ROOT %e = f32[8,16]{1,0} exponential(%n)
}

%cheap (a2: f32[8,16]) -> f32[8,16] {
  ROOT %a2 = f32[8,16]{1,0} parameter(0)
}

ENTRY %main (w0: f32[4,8,16], i0: s32[], c0: f32[4,16], r0: f32[1,16], p: pred[]) -> f32[8,16] {
  %w0 = f32[4,8,16]{2,1,0} parameter(0)
  %i0 = s32[] parameter(1)
  %c0 = f32[4,16]{1,0} parameter(2)
  %r0 = f32[1,16]{1,0} parameter(3)
  %p = pred[] parameter(4)
  %f = (f32[8,16]{1,0}, f32[4,16]{1,0}) fusion(%w0, %i0, %c0, %r0), kind=kLoop, calls=%fused_slice
  %x = f32[8,16]{1,0} get-tuple-element(%f), index=0
  ROOT %y = f32[8,16]{1,0} conditional(%p, %x, %x), branch_computations={%expensive, %cheap}, metadata={op_name="jit(f)/attention_tile/cond"}
}
"""


def test_kernel_costs_by_hand():
    """The fusion reads its slice of the weights (512 B), the index (4 B) and the new row (64 B), and writes the
    slice (512 B) and the row into the cache (64 B): 1,156 B, not the 2,048 + 256 B of the whole weights and cache;
    the conditional runs both expensive kernels (512 + 512 B each) always by default, a quarter of the time under
    `taken`, its cheap branch (no kernel) the rest."""
    from jaxrl_llm.capacity.gpu_targets import GPUS, LAUNCH_SECONDS, predict_seconds
    from jaxrl_llm.capacity.hlo_stats import kernel_costs
    from jaxrl_llm.models.layers import TILE_SCOPE

    assert kernel_costs(FUSION_HLO) == [(1.0, 0.0, 512 + 4 + 64 + 512 + 64), (1.0, 0.0, 1024.0), (1.0, 0.0, 1024.0)]
    assert TILE_SCOPE == "attention_tile"
    assert kernel_costs(FUSION_HLO, {TILE_SCOPE: 0.25}) == [(1.0, 0.0, 1156.0), (0.25, 0.0, 1024.0),
                                                           (0.25, 0.0, 1024.0)]
    h200 = GPUS["h200"]  # bytes-bound kernels: bytes / 2.79 TB/s + the launch cost each
    expected = 1156 / 2.79e12 + 2 * 0.25 * 1024 / 2.79e12 + 1.5 * LAUNCH_SECONDS
    assert abs(predict_seconds(kernel_costs(FUSION_HLO, {TILE_SCOPE: 0.25}), h200) - expected) < 1e-15
    # the launch cost is the one benchmarks/gpu_model.py fitted on the measured H200 step
    fitted = json.loads((CONFIGS.parent / "benchmarks" / "results" / "gpu_model.json").read_text())
    assert round(fitted["launch_seconds_fitted"], 8) == LAUNCH_SECONDS
    assert fitted["programs"]["packed_xla_28_layers_2_rows"]["measured_s"] == 33.714942058999995


def test_docs_gpu_launch_table_is_the_saved_compiles():
    """docs/launch.md's GPU launch table is what scripts/compile_table.py --gpu writes from the saved compiles of
    every paper preset on h100-8 (benchmarks/results/compile/*_h100-8.json, estimates from today's
    estimate_memory), and in it every program fits and every train step runs cuDNN attention."""
    import importlib.util

    from jaxrl_llm.run.config import load_config

    root = CONFIGS.parent
    spec = importlib.util.spec_from_file_location("compile_table", root / "scripts" / "compile_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert len(table.GPU_ROWS) == 8
    results = []
    for preset, topology, _ in table.GPU_ROWS:
        saved = json.loads((root / "benchmarks/results/compile" / f"{pathlib.Path(preset).stem}_{topology}.json")
                           .read_text())
        results.append((preset, topology, saved["overrides"],
                        aot.refresh_estimates(load_config(root / preset, saved["overrides"]), saved)))
    expected = table.gpu_table(results)
    doc = (root / "docs" / "launch.md").read_text()
    assert doc.split(table.GPU_START)[1].split(table.GPU_END)[0].strip() == expected, \
        "docs/launch.md is stale: python scripts/compile_table.py --gpu --reuse --write docs/launch.md"
    for _, _, _, result in results:
        programs = {p["name"]: p for p in result["programs"]}
        assert all(p["fits"] for p in programs.values()), programs
        assert programs["train_step"]["attention_kernel"] == "cudnn"
        assert programs["train_step"]["matmul_flops"] <= 1.6 * programs["train_step"]["model_flops"]


@needs_plugin
def test_gpu_decode_reads_every_response_tile_in_fewer_kernels():
    """The sampler's decode step compiled for an H200 (a tiny model at 256 new tokens: response tiles): reading
    every tile (`decoder.GPU_DECODE_READS`, as on a TPU) compiles to no conditional and fewer kernels per generated
    token than the CPU's switch over the tiles written so far, one conditional per full-attention layer."""
    from jaxrl_llm.run.config import load_config
    from jaxrl_llm.sampling import decoder

    cfg = load_config(CONFIGS / "grpo.yaml", ["sampling.max_new_tokens=256", "data.max_prompt_tokens=64",
                                             "sampling.prompts_per_step=2", "train.mesh=fsdp=1"])
    decode = {}
    for reads in ("every", "reached"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decoder, "GPU_DECODE_READS", reads)
            (decode[reads],) = aot.compile_run(cfg, "h200-1", model_config=TINY, only=("sampler_decode",))["programs"]
    assert decoder.GPU_DECODE_READS == "every"
    assert decode["every"].conditionals == 0 and decode["reached"].conditionals == TINY.num_layers, decode
    assert decode["every"].kernels < decode["reached"].kernels, decode


@needs_plugin
def test_distillation_teacher_pass_and_topk_step_compile():
    """`jaxrl-llm compile` of a distillation run: the teacher's pass (distill.mode topk: its top-K pass) with the
    teacher's weights in bfloat16 (its arguments: 2 bytes a parameter and the packed rollouts), and the train step
    on mini-batches that carry the teacher's top_k ids and log-probs [rows, S, R, K] (absent without topk); a
    teacher of its own shape (`teacher_config`: one layer more) in float32; each pass's estimate is the teacher's
    weights and its pass's buffers (`estimate_memory`'s teacher and teacher_pass)."""
    import jax

    from jaxrl_llm.models.model import init_params
    from jaxrl_llm.run.config import ConfigError, load_config
    from jaxrl_llm.run.shapes import step_shapes

    base = ["sampling.max_new_tokens=8", "data.max_prompt_tokens=16", "optim.micro_batch_size=2",
            "sampling.prompts_per_step=4", "train.mesh=fsdp=1", "distill.teacher=some/folder"]
    cfg = load_config(CONFIGS / "grpo.yaml", base + ["distill.mode=topk", "distill.top_k=8",
                                                     "distill.teacher_dtype=bfloat16"])
    result = aot.compile_run(cfg, "h200-1", model_config=TINY, only=("train_step", "teacher_pass"))
    table = aot.format_report(result)
    assert [p.name for p in result["programs"]] == ["train_step", "teacher_pass"], table
    assert all(p.fits and not p.error for p in result["programs"]), table
    shapes = step_shapes(cfg, {"data": 1, "fsdp": 1, "tensor": 1})
    batch = aot.batch_shapes(cfg, shapes)
    rows, slots = result["rows"], shapes.responses_per_row
    assert batch.teacher_ids.shape == batch.teacher_topk_logp.shape == (rows, slots, 8, 8)
    assert result["programs"][0].argument_bytes > 8 * rows * slots * 8 * 8, table  # the top-K fields are read
    # mode sampled, a float32 teacher of 3 layers (teacher_config): its weights at 4 bytes a parameter, and the packed
    # rollouts with the response tokens (the top-K pass reads no target): [rows, S, R] int32 more
    cfg = load_config(CONFIGS / "grpo.yaml", base)
    deeper = TINY.replace(num_layers=3)
    own = aot.compile_run(cfg, "h200-1", model_config=TINY, only=("teacher_pass",), teacher_config=deeper)
    (sampled,) = own["programs"]
    elements, deeper_elements = (sum(leaf.size for leaf in jax.tree_util.tree_leaves(
        jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0))))) for mc in (TINY, deeper))
    topk_pass = result["programs"][1]
    assert sampled.argument_bytes - topk_pass.argument_bytes == 4 * deeper_elements - 2 * elements \
        + 4 * rows * slots * 8, table
    assert topk_pass.output_bytes >= 8 * rows * slots * 8 * 8 > sampled.output_bytes, table  # ids + log-probs
    assert own["estimate"]["teacher"] == 4 * deeper_elements
    assert topk_pass.estimate_bytes == 2 * elements + result["estimate"]["teacher_pass"], table
    assert sampled.estimate_bytes == 4 * deeper_elements + own["estimate"]["teacher_pass"], table
    with pytest.raises(ConfigError, match="has 256 tokens and the policy's 512"):  # the run's vocabulary check
        aot.compile_run(cfg, "h200-1", model_config=TINY, only=("teacher_pass",),
                        teacher_config=TINY.replace(vocab_size=256))
    est = result["estimate"]  # beside it: the trainer's state and the KL reference (grpo.yaml's kl_coef)
    assert est["reference"] > 0 and topk_pass.resident_bytes == est["params"] + est["optimizer"] + est["reference"]
    no_topk = aot.batch_shapes(cfg, shapes)
    assert no_topk.teacher_ids is None and no_topk.teacher_topk_logp is None
