"""Command line: `jaxrl-llm train | eval | sample | convert | plot | compile`.

    jaxrl-llm sample --prompt "What is 7 + 5?"            # bundled SmolLM2-135M-Instruct, greedy
    jaxrl-llm sample --gguf model.gguf --temperature 0.7  # a Llama / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 GGUF
    jaxrl-llm sample --model hf_folder                    # a Hugging Face checkpoint folder
    jaxrl-llm convert out_dir [--gguf model.gguf]         # GGUF -> HF folder (config, safetensors, tokenizer)
    jaxrl-llm convert out_dir --model hf_folder --adapter peft_folder   # base + LoRA adapter -> merged HF folder
    jaxrl-llm train                                       # the embedded RL demo on the bundled model
    jaxrl-llm train --config configs/grpo.yaml optim.lr=1e-5 train.steps=50 [--resume]
    jaxrl-llm train --distributed --config ...            # one process per host (TPU pod, SLURM): docs/launch.md
    jaxrl-llm eval --benchmarks arithmetic-heldout gsm8k-100 -k 8
    jaxrl-llm plot runs/default                           # PNG curves of a run (several runs: one figure)
    jaxrl-llm compile --config configs/paper/... --topology v5litepod-64   # a run's programs for a TPU slice
    jaxrl-llm compile --config configs/paper/... --topology h200-8         # ... or for GPU hosts
"""

from __future__ import annotations

import argparse
import os
import sys
import time

def _say(message: str) -> None:
    print(message, flush=True)


def _load(args):
    """(config, params, tokenizer) named by --gguf / --model, else the bundled model."""
    start = time.perf_counter()
    if args.gguf:
        from jaxrl_llm.models.gguf import load_gguf

        source = args.gguf
        config, params, tokenizer = load_gguf(args.gguf, dtype=args.dtype)
    elif args.model:
        from jaxrl_llm.models.hf_io import load_hf
        from jaxrl_llm.models.tokenizer import Tokenizer

        source = args.model
        config, params = load_hf(args.model, dtype=args.dtype)
        tokenizer = Tokenizer.from_pretrained(args.model)
    else:
        from jaxrl_llm.models.bundled import bundled_gguf_path, load_bundled

        source = f"bundled {bundled_gguf_path().name}"
        config, params, tokenizer = load_bundled(dtype=args.dtype)
    import jax

    count = sum(x.size for x in jax.tree_util.tree_leaves(params))
    _say(f"loaded {source}: {config.model_type}, {config.num_layers} layers, {count:,} parameters "
         f"({config.param_dtype}) in {time.perf_counter() - start:.1f} s")
    if args.adapter:
        params = _merge_adapter(config, params, args.adapter)
    return config, params, tokenizer


def _merge_adapter(config, params, adapter_dir):
    """`params` with the PEFT LoRA adapter in `adapter_dir` merged into its weights (W + s A B)."""
    import jax

    from jaxrl_llm.models.lora import merge
    from jaxrl_llm.models.peft_io import load_peft

    spec, adapters = load_peft(adapter_dir, config)
    merged = jax.jit(merge, static_argnums=2)(params, adapters, spec.scale)
    _say(f"merged adapter {adapter_dir}: rank {spec.rank}, alpha {spec.alpha:g}, {', '.join(spec.targets)}")
    return merged


def _sample(config, params, tokenizer, messages, args) -> list[str]:
    import jax

    from jaxrl_llm.sampling import generate

    prompt = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    _say(f"prompt: {len(prompt_ids)} tokens; sampling {args.num_samples} x up to {args.max_new_tokens} new tokens "
         f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}'})")
    start = time.perf_counter()
    rollout = generate(params, config, [prompt_ids], num_samples=args.num_samples,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, stop_ids=tokenizer.stop_ids, rng=jax.random.PRNGKey(args.seed),
                       pad_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode([int(t) for t in row[:n]]) for row, n in zip(rollout.tokens, rollout.lengths)]
    for i, text in enumerate(texts):
        _say(f"--- completion {i + 1} ---" if len(texts) > 1 else "--- completion ---")
        _say(text)
    _say("------------------")
    _say(f"{int(rollout.lengths.sum())} tokens in {seconds:.2f} s (compilation included)")
    return texts


def _cmd_sample(args) -> int:
    config, params, tokenizer = _load(args)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    _sample(config, params, tokenizer, messages, args)
    return 0


def _cmd_convert(args) -> int:
    from jaxrl_llm.models.hf_io import save_hf

    config, params, tokenizer = _load(args)
    start = time.perf_counter()
    out = save_hf(args.out, config, params, tokenizer=tokenizer)
    _say(f"wrote {out} (config.json, model.safetensors, tokenizer files) in {time.perf_counter() - start:.1f} s")
    return 0


DISTRIBUTED_ENV = "JAXRL_DISTRIBUTED"


def init_distributed() -> tuple[int, int]:
    """Join the multi-controller runtime: `jax.distributed.initialize()`, before any JAX computation.

    On a Cloud TPU VM slice and under SLURM (srun) JAX finds the coordinator, the process count and this
    process's id by itself. Elsewhere set JAX_COORDINATOR_ADDRESS (host:port of process 0, read by JAX),
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; explicit values also override the detection. A no-op when
    already initialised. Returns (process_index, process_count).
    """
    import jax

    already = getattr(jax.distributed, "is_initialized", lambda: False)  # not in every supported JAX version
    if not already():
        kwargs = {}
        for env, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
            value = os.environ.get(env, "").strip()
            if value:
                if not value.isdigit():
                    raise ValueError(f"environment variable {env} must be a non-negative integer, got {value!r}")
                kwargs[key] = int(value)
        jax.distributed.initialize(**kwargs)
    return jax.process_index(), jax.process_count()


def _cmd_train(args) -> int:
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train

    if args.distributed or os.environ.get(DISTRIBUTED_ENV, "0") not in ("", "0"):
        index, count = init_distributed()
        _say(f"jax.distributed: process {index} of {count}")
    config = load_config(args.config, args.overrides)
    _say(f"jaxrl-llm train: algorithm {config.algorithm.name}, model {config.model.source}, "
         f"{config.train.steps} steps of {config.sampling.prompts_per_step} prompts x "
         f"{config.sampling.samples_per_prompt} samples, run dir {config.train.out_dir}")
    summary = train(config, resume=args.resume, log=_say)
    return 0 if summary.get("status") in ("done", "preempted") else 1


def _cmd_compile(args) -> int:
    # Off a TPU, compiling for one needs only libtpu's compiler: the CPU backend runs the host side, and libtpu
    # is not asked to open a TPU (which prints errors and takes its lockfile) unless one is named.
    import re

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if re.fullmatch(r"[ah]\d+-\d+(x\d+)?", args.topology.strip().lower()):
        # GPU hosts: without a GPU here, the CUDA plugin registers only if its check of the CUDA libraries is skipped
        # (JAX_PLATFORMS=cpu skips it too, unless the user asked for another platform); read as jax starts
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import dataclasses
    import json

    from jaxrl_llm.capacity.aot import (CudaPluginMissing, LibtpuMissing, compile_run, format_report,
                                        teacher_config_for)
    from jaxrl_llm.train import load_config

    config = load_config(args.config, args.overrides)
    _say(f"jaxrl-llm compile: {config.model.source} ({config.algorithm.name}) for {args.topology}, "
         f"train.mesh={config.train.mesh!r}")
    teacher = teacher_config_for(config)
    if config.distill.teacher and teacher is None:
        _say(f"jaxrl-llm compile: distill.teacher={config.distill.teacher!r} compiled with the policy's shape")
    try:
        result = compile_run(config, args.topology, only=tuple(args.programs.split(",")) if args.programs else None,
                             teacher_config=teacher)
    except (LibtpuMissing, CudaPluginMissing) as err:
        print(f"jaxrl-llm compile: error: {err}", file=sys.stderr)
        return 2
    _say(format_report(result))
    if args.json:
        out = {**result, "programs": [dataclasses.asdict(p) for p in result["programs"]]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = [p.name for p in result["programs"] if not p.fits]
    if failed:
        print(f"jaxrl-llm compile: {failed[0]} does not fit {args.topology}'s HBM", file=sys.stderr)
        return 1
    return 0


def _cmd_eval(args) -> int:
    from jaxrl_llm.eval import evaluate_benchmarks

    config, params, tokenizer = _load(args)
    evaluate_benchmarks(params, config, tokenizer, args.benchmarks, k=args.k, max_new_tokens=args.max_new_tokens,
                        limit=args.limit, out_path=args.out, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, template=args.prompt, seed=args.seed)
    return 0


def _cmd_plot(args) -> int:
    from jaxrl_llm.plot import plot_run

    drawn = plot_run(args.run_dirs, args.out, x=args.x)
    _say(f"wrote {drawn.path}\n{drawn.plan.summary()}")
    return 0


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gguf", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    source.add_argument("--model", metavar="DIR", help="a Hugging Face checkpoint folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="parameter dtype")
    parser.add_argument("--adapter", metavar="DIR", default=None,
                        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, ours or "
                             "peft's) for this base model, merged into its weights")


def _add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int, temperature: float = 0.0) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-llm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="chat-template a prompt and sample a completion")
    _add_model_args(sample)
    _add_sampling_args(sample, max_new_tokens=64)
    sample.add_argument("--prompt", default="What is 7 + 5?")
    sample.add_argument("--system", default=None, help="optional system message")
    sample.add_argument("--num-samples", type=int, default=1)
    sample.set_defaults(run=_cmd_sample)
    convert = commands.add_parser(
        "convert", help="write a model (a GGUF file, or a base and a LoRA adapter merged) as a Hugging Face folder")
    convert.add_argument("out", help="output folder")
    _add_model_args(convert)
    convert.set_defaults(run=_cmd_convert)
    train = commands.add_parser(
        "train", help="RL training (no arguments: the embedded demo on the bundled model)",
        description="RL training from a YAML preset (configs/) and section.key=value overrides.")
    train.add_argument("--config", metavar="YAML", default=None, help="a preset such as configs/grpo.yaml")
    train.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    train.add_argument("--distributed", action="store_true",
                       help=f"call jax.distributed.initialize() first: one process per host (also when "
                            f"{DISTRIBUTED_ENV}=1); see docs/launch.md")
    train.add_argument("overrides", nargs="*", metavar="section.key=value")
    train.set_defaults(run=_cmd_train)
    compile_ = commands.add_parser(
        "compile", help="compile a run's programs for a TPU slice or GPU hosts (no TPU or GPU needed; libtpu: pip "
                        "install 'jaxrl_llm[tpu]', CUDA plugin: 'jaxrl_llm[gpu-compile]') and report each program's "
                        "memory per chip, kernels and matmul FLOPs")
    compile_.add_argument("--config", metavar="YAML", default=None, help="a preset such as configs/paper/...")
    compile_.add_argument("--topology", required=True,
                          help="a slice: v4-8, v4-32, v5litepod-8, v5litepod-64, v5p-8, v6e-8, ... or v5e:4x4; GPU "
                               "hosts: h100-8, h200-1, h200-8, a100-8, h100-8x2 (two hosts)")
    compile_.add_argument("--json", metavar="OUT", default=None, help="write the table as JSON here")
    compile_.add_argument("--programs", metavar="NAMES", default=None,
                          help="only these of the run's programs, comma-separated (train_step, logprob_pass, "
                               "teacher_pass, critic_step, gvm_grad_norms, sampler_prefill, sampler_decode, "
                               "sampler_continuous)")
    compile_.add_argument("overrides", nargs="*", metavar="section.key=value")
    compile_.set_defaults(run=_cmd_compile)
    evaluation = commands.add_parser("eval", help="avg@k / pass@k / maj@k of a model on benchmark sets")
    _add_model_args(evaluation)
    _add_sampling_args(evaluation, max_new_tokens=32, temperature=1.0)
    evaluation.add_argument("--benchmarks", nargs="+", default=["arithmetic-heldout"],
                            help="registry names (arithmetic-heldout, gsm8k-100, champ, ...) or JSONL files")
    evaluation.add_argument("-k", type=int, default=4, help="samples per problem")
    evaluation.add_argument("--limit", type=int, default=None, help="first N problems of each set")
    evaluation.add_argument("--prompt", default="arithmetic-2shot", help="a prompt preset (jaxrl_llm.data)")
    evaluation.add_argument("--out", default=None, help="write the results as JSON here")
    evaluation.set_defaults(run=_cmd_eval)
    plot = commands.add_parser("plot", help="PNG curves of one or several run directories' metrics.jsonl")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="several: one figure, a colour per run")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png for one run; for several, "
                                                  "curves_A_vs_B.png in their common folder)")
    plot.add_argument("--x", choices=("steps", "samples"), default="steps",
                      help="x-axis: training steps, or samples drawn so far (samples_drawn)")
    plot.set_defaults(run=_cmd_plot)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """`build_parser`'s arguments, where section.key=value overrides may also follow an option (`train --config X
    a.b=1 --resume c.d=2`: argparse alone takes the overrides before the first option and refuses the rest); they
    keep their order, the later winning."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [arg for arg in extra if arg.startswith("-") or "=" not in arg or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv=None) -> int:
    """Entry point of the `jaxrl-llm` console script; returns the exit status."""
    from jaxrl_llm.platforms import quiet_absent_accelerators

    quiet_absent_accelerators()  # before jax is imported: no libtpu or CUDA plugin probe where its device is absent
    args = parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as err:
        print(f"jaxrl-llm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
