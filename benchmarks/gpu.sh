#!/usr/bin/env bash
# The GPU checks behind benchmarks/README.md's "GPU" section, as one command for a machine with one CUDA GPU,
# JAX with its CUDA plugin, torch and transformers: benchmarks/gpu.py, then the test files that exercise the
# device numerics (model, attention, sampler, objectives, log-probs, train step, LoRA), in 8 pytest-xdist
# workers sharing the GPU (the tests that load the bundled model, marked slow, are left out). About 8 minutes.
# The benchmark's figures go to OUT_DIR/gpu.json and to benchmarks/results/gpu_<card>.json (card: h200, h100, ...),
# whose train part answers the GPU issue: train.ours_step_s, train.torch_step_s, train.ours_vs_torch, train.ours_mfu
# for the default attention path (model.attention_impl=auto), and train.xla.* for the packed XLA path beside it.
#   bash benchmarks/gpu.sh [OUT_DIR] [BENCH_SECONDS] [TEST_SECONDS]
set -u
out=${1:-gpu_out}
bench_s=${2:-330}
test_s=${3:-120}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
start=$SECONDS
timeout "$bench_s" python3 benchmarks/gpu.py --out "$out" 2>&1 | tee "$out/bench.log"
echo "[benchmark: $((SECONDS - start)) s]"
card=$(python3 -c "import json, re; kind = json.load(open('$out/gpu.json'))['device_kind']; \
print((re.findall(r'[A-Z]\d{2,3}', kind) or [kind.replace(' ', '_')])[0].lower())")
cp "$out/gpu.json" "benchmarks/results/gpu_$card.json" && echo "[wrote benchmarks/results/gpu_$card.json]"
tests=(test_attention_blocks test_model_layers test_model_parity test_model_unrolled test_model_windowed
       test_objectives_advantages test_objectives_kl test_objectives_losses test_objectives_mstep
       test_objectives_peers test_objectives_prl_gvm test_sampling test_sampling_chunks test_sampling_continuous
       test_sampling_reference test_train_logprobs test_train_step test_lora test_flax_modules test_quant test_ppo
       test_gvm test_hf_io)
paths=()
for t in "${tests[@]}"; do paths+=("tests/$t.py"); done
start=$SECONDS
XLA_FLAGS="--xla_gpu_autotune_level=0" timeout "$test_s" python3 -m pytest -p no:cacheprovider -m "not slow" -n 8 -v --timeout 120 -rfE \
  "${paths[@]}" --junitxml="$out/tests.xml" > "$out/tests.log" 2>&1
echo "[tests: rc $? in $((SECONDS - start)) s]"
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/tests.log" | tail -60
grep -cE "PASSED" "$out/tests.log" | sed 's/^/passed so far: /'
