"""Command line: `jaxrl-llm sample | convert | train`.

    jaxrl-llm sample --prompt "What is 7 + 5?"            # bundled SmolLM2-135M-Instruct, greedy
    jaxrl-llm sample --gguf model.gguf --temperature 0.7  # any Llama / Qwen2 / Qwen3 GGUF
    jaxrl-llm sample --model hf_folder                    # a Hugging Face checkpoint folder
    jaxrl-llm convert out_dir [--gguf model.gguf]         # GGUF -> HF folder (config, safetensors, tokenizer)
    jaxrl-llm train                                       # the default job on the bundled model
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

# Fixed prompt of the default job: the single-step arithmetic shape the bundled model answers best.
DEMO_MESSAGES = (
    {"role": "user", "content": "3 + 4 = ?"},
    {"role": "assistant", "content": "3 + 4 = 7 \\boxed{7}"},
    {"role": "user", "content": "9 - 5 = ?"},
    {"role": "assistant", "content": "9 - 5 = 4 \\boxed{4}"},
    {"role": "user", "content": "5 + 2 = ?"},
)
_PREFILL_BUCKET = 64  # prompt lengths round up to this, so nearby lengths share one compiled prefill


def _lazy_jit(fn, **jit_kwargs):
    """jax.jit applied on first call, so `import jaxrl_llm.cli` (and --help) does not import jax."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if compiled is None:
            import jax

            compiled = jax.jit(fn, **jit_kwargs)
        return compiled(*args)

    return call


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
    return config, params, tokenizer


def _choose(logits, key, temperature):
    """argmax(logits) when temperature == 0, else a draw from softmax(logits / temperature)."""
    import jax
    import jax.numpy as jnp

    scaled = logits / jnp.maximum(temperature, 1e-6)
    return jnp.where(temperature > 0, jax.random.categorical(key, scaled), jnp.argmax(logits)).astype(jnp.int32)


@functools.partial(_lazy_jit, static_argnums=(1,), donate_argnums=(4,))
def _prefill(params, config, tokens, last, cache, key, temperature):
    """Write the right-padded prompt [1, bucket] into the cache; choose the token after index `last`."""
    import jax.numpy as jnp

    from jaxrl_llm.models.model import forward_cached

    positions = jnp.arange(tokens.shape[1])[None]
    logits, cache = forward_cached(params, config, tokens, positions, cache)
    return _choose(logits[0, last], key, temperature), cache


@functools.partial(_lazy_jit, static_argnums=(1,), donate_argnums=(4,))
def _decode(params, config, token, position, cache, key, temperature):
    """Feed one token at `position`; choose the next one."""
    from jaxrl_llm.models.model import forward_cached

    logits, cache = forward_cached(params, config, token[None, None], position[None, None], cache)
    return _choose(logits[0, -1], key, temperature), cache


def _generate(params, config, prompt_ids, *, max_new_tokens, temperature=0.0, stop_ids=(), seed=0):
    """Sample up to `max_new_tokens` ids after `prompt_ids` for one row; returns (ids, timings).

    Prefill writes the right-padded prompt into a KV cache with forward_cached; each decode step
    feeds the last token at the next position (one jitted step per token). Greedy when
    temperature == 0. Stops after the first id in `stop_ids`."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models.model import init_cache

    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    length = len(prompt_ids)
    bucket = -(-length // _PREFILL_BUCKET) * _PREFILL_BUCKET
    cache_len = -(-max(bucket, length + max_new_tokens) // _PREFILL_BUCKET) * _PREFILL_BUCKET
    keys = jax.random.split(jax.random.PRNGKey(seed), max_new_tokens)
    temperature = jnp.float32(temperature)
    tokens = jnp.zeros((1, bucket), jnp.int32).at[0, :length].set(jnp.asarray(prompt_ids, jnp.int32))
    start = time.perf_counter()
    token, cache = _prefill(params, config, tokens, jnp.int32(length - 1), init_cache(config, 1, cache_len),
                            keys[0], temperature)
    out = [int(token)]
    timing = {"prefill_s": time.perf_counter() - start, "first_decode_s": 0.0, "decode_s": 0.0}
    for step in range(1, max_new_tokens):
        if out[-1] in stop_ids:
            break
        start = time.perf_counter()
        token, cache = _decode(params, config, token, jnp.int32(length + step - 1), cache, keys[step], temperature)
        out.append(int(token))
        timing["first_decode_s" if step == 1 else "decode_s"] += time.perf_counter() - start
    return out, timing


def _sample(config, params, tokenizer, messages, args) -> str:
    prompt = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    _say(f"prompt: {len(prompt_ids)} tokens; sampling {args.max_new_tokens} new tokens "
         f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}'})")
    ids, timing = _generate(params, config, prompt_ids, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, stop_ids=tokenizer.stop_ids, seed=args.seed)
    text = tokenizer.decode(ids)
    _say("--- completion ---")
    _say(text)
    _say("------------------")
    steady = len(ids) - 2  # the first id comes from prefill, the first decode step compiles
    rate = f"{steady / timing['decode_s']:.1f} tok/s" if steady > 0 and timing["decode_s"] > 0 else "n/a"
    _say(f"{len(ids)} tokens: prefill {timing['prefill_s']:.2f} s and first decode step "
         f"{timing['first_decode_s']:.2f} s (both compile), then {rate}")
    return text


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


def _cmd_train(args) -> int:
    _say("The RL trainer is not available yet; running the sampling demo on a fixed arithmetic prompt.")
    config, params, tokenizer = _load(args)
    _sample(config, params, tokenizer, DEMO_MESSAGES, args)
    return 0


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gguf", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    source.add_argument("--model", metavar="DIR", help="a Hugging Face checkpoint folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="parameter dtype")


def _add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-llm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="chat-template a prompt and sample a completion")
    _add_model_args(sample)
    _add_sampling_args(sample, max_new_tokens=64)
    sample.add_argument("--prompt", default="What is 7 + 5?")
    sample.add_argument("--system", default=None, help="optional system message")
    sample.set_defaults(run=_cmd_sample)
    convert = commands.add_parser("convert", help="write a GGUF model as a Hugging Face folder")
    convert.add_argument("out", help="output folder")
    _add_model_args(convert)
    convert.set_defaults(run=_cmd_convert)
    train = commands.add_parser("train", help="the default job (for now: the sampling demo)")
    _add_model_args(train)
    _add_sampling_args(train, max_new_tokens=32)
    train.set_defaults(run=_cmd_train)
    return parser


def main(argv=None) -> int:
    """Entry point of the `jaxrl-llm` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"jaxrl-llm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
