"""jaxrl-llm CLI: convert (GGUF -> HF folder loadable by transformers), sample, train demo, errors."""

import json

import jax
import numpy as np
import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.models import forward, load_hf
from jaxrl_llm.models.gguf import load_gguf
from jaxrl_llm.models.tokenizer import Tokenizer
from tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "llama", seed=11)
    return path


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "hf"
    assert main(["convert", str(out), "--gguf", str(tiny_gguf)]) == 0
    return out


def _greedy_by_full_forward(params, config, prompt, steps, stop_ids, width=128):
    """Reference decoder: re-run the whole sequence each step (no cache), take the argmax. The
    sequence is right-padded to `width` (causal attention: later slots do not change earlier logits)."""
    import jax

    full_forward = jax.jit(forward, static_argnums=1)
    seq = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(seq)] = seq
        logits = full_forward(params, config, padded, np.arange(width)[None])
        seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
        if seq[-1] in stop_ids:
            break
    return seq[len(prompt):]


def _completion(stdout: str) -> str:
    return stdout.split("--- completion ---\n", 1)[1].split("\n------------------\n", 1)[0]


def test_convert_writes_a_folder_transformers_loads_with_the_same_logits(tiny_gguf, converted):
    torch = pytest.importorskip("torch")
    import transformers

    assert {p.name for p in converted.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    config, params, tokenizer = load_gguf(tiny_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 9))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = forward(params, config, tokens, np.broadcast_to(np.arange(9), (2, 9)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted))
    text = "<|im_start|>user\n the 12 café<|im_end|>\n"
    assert hf_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text)


def test_converted_folder_reloads_as_the_same_params(tiny_gguf, converted):
    _, params, _ = load_gguf(tiny_gguf)
    _, reloaded = load_hf(converted)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reloaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sample_with_temperature_is_seeded(converted, capsys):
    args = ["sample", "--model", str(converted), "--prompt", "the 12", "--max-new-tokens", "8", "--temperature", "5"]
    outs = []
    for seed in ("3", "3", "4"):
        assert main(args + ["--seed", seed]) == 0
        outs.append(_completion(capsys.readouterr().out))
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_sample_on_a_tiny_model_folder_prints_the_greedy_completion(converted, capsys):
    assert main(["sample", "--model", str(converted), "--prompt", "the 12", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    config, params = load_hf(converted)
    tokenizer = Tokenizer.from_pretrained(converted)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "the 12"}]))
    assert f"prompt: {len(prompt)} tokens" in out
    expected = _greedy_by_full_forward(params, config, prompt, 8, tokenizer.stop_ids)
    assert _completion(out) == tokenizer.decode(expected)
    assert "loaded " in out and f"{sum(x.size for x in jax.tree_util.tree_leaves(params)):,} parameters" in out
    assert "tokens in" in out


def test_train_and_eval_and_plot_commands(converted, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [f"model.source={converted}", "data.prompt=raw", "train.steps=1", "train.eval_problems=2",
                 "train.eval_samples=1", "sampling.prompts_per_step=2", "sampling.samples_per_prompt=2",
                 "sampling.max_new_tokens=4", "optim.micro_batch_size=4", f"train.out_dir={run_dir}"]
    assert main(["train", *overrides]) == 0
    out = capsys.readouterr().out
    assert "eval before training: avg@1" in out and "eval after training: avg@1" in out
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert main(["train", *overrides]) == 2  # a second fresh run would mix with the first one's checkpoints
    assert "already holds checkpoints" in capsys.readouterr().err
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "--model", str(converted), "--benchmarks", "arithmetic-heldout", "--limit", "3", "-k", "2",
                 "--prompt", "raw", "--max-new-tokens", "4", "--out", str(tmp_path / "eval.json")]) == 0
    assert "arithmetic-heldout" in capsys.readouterr().out and (tmp_path / "eval.json").is_file()


def test_train_config_errors_exit_2(capsys):
    assert main(["train", "optim.learning_rate=1"]) == 2
    assert "did you mean 'optim.lr'" in capsys.readouterr().err
    assert main(["train", "optim.lr=-1"]) == 2
    assert "'optim.lr' must be > 0" in capsys.readouterr().err


def test_overrides_may_follow_an_option_and_keep_their_order(capsys):
    from jaxrl_llm.cli import parse_args

    args = parse_args(["train", "--config", "c.yaml", "train.steps=5", "--resume", "train.steps=7", "a.b=1"])
    assert args.resume and args.config == "c.yaml" and args.overrides == ["train.steps=5", "train.steps=7", "a.b=1"]
    assert parse_args(["compile", "--topology", "h200-1", "a.b=1", "--programs", "train_step", "c.d=2"]).overrides \
        == ["a.b=1", "c.d=2"]
    for stray in (["train", "a.b=1", "--bogus"], ["train", "a.b=1", "--resume", "word"]):
        with pytest.raises(SystemExit):
            parse_args(stray)
        assert "unrecognized arguments: " + stray[-1] in capsys.readouterr().err


def test_bad_inputs_give_one_clear_error(tmp_path, capsys):
    assert main(["sample", "--gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "jaxrl-llm sample: error: " in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "out"), "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such checkpoint directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["sample", "--gguf", str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt: not a GGUF file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sample", "--gguf", "a.gguf", "--model", "dir"])  # the two sources exclude each other


@pytest.fixture(scope="module")
def peft_adapter(converted, tmp_path_factory):
    """An adapter written by `peft` itself (A and B random, so it changes the logits) on the converted model."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from tiny_models import load_torch_model

    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(load_torch_model(str(converted)), config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.mul_(3.0)  # peft's random B is small; make the adapter's effect on the logits clear
    out = tmp_path_factory.mktemp("adapter") / "peft"
    model.save_pretrained(str(out))
    return out


def test_convert_with_a_peft_adapter_writes_the_merged_model_peft_computes(converted, peft_adapter, tmp_path):
    peft = pytest.importorskip("peft")
    from tiny_models import load_torch_model, torch_logits

    out = tmp_path / "merged"
    assert main(["convert", str(out), "--model", str(converted), "--adapter", str(peft_adapter)]) == 0
    tokens = np.random.default_rng(2).integers(0, 64, size=(2, 9))
    want = torch_logits(peft.PeftModel.from_pretrained(load_torch_model(str(converted)), str(peft_adapter)), tokens)
    base = torch_logits(load_torch_model(str(converted)), tokens)
    assert np.abs(want - base).max() > 1e-2  # the adapter is live
    np.testing.assert_allclose(torch_logits(load_torch_model(str(out)), tokens), want, atol=1e-4, rtol=0)
    assert (out / "tokenizer.json").is_file()


def test_sample_and_eval_with_an_adapter_read_the_adapted_model(converted, peft_adapter, capsys, monkeypatch):
    from jaxrl_llm.models import lora
    from jaxrl_llm.models.peft_io import load_peft

    args = ["sample", "--model", str(converted), "--prompt", "the 12", "--max-new-tokens", "8"]
    assert main(args + ["--adapter", str(peft_adapter)]) == 0
    out = capsys.readouterr().out
    assert "merged adapter" in out and "rank 4, alpha 6" in out
    config, params = load_hf(converted)
    spec, adapters = load_peft(peft_adapter, config)
    tokenizer = Tokenizer.from_pretrained(converted)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "the 12"}]))
    # Reference: the adapters applied on the fly (x W + (x A)(s B)), not merged, with a cache-free decoder.
    expected = _greedy_by_full_forward(lora.attach(params, adapters, spec.scale), config, prompt, 8,
                                       tokenizer.stop_ids)
    assert _completion(out) == tokenizer.decode(expected)
    assert expected != _greedy_by_full_forward(params, config, prompt, 8, tokenizer.stop_ids)
    # eval hands evaluate_benchmarks the adapted model: its logits are the on-the-fly adapters' logits.
    seen = {}
    monkeypatch.setattr("jaxrl_llm.eval.evaluate_benchmarks", lambda params, *a, **k: seen.update(params=params))
    assert main(["eval", "--model", str(converted), "--adapter", str(peft_adapter)]) == 0
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(2, 9))
    positions = np.broadcast_to(np.arange(9), (2, 9))
    want = np.asarray(forward(lora.attach(params, adapters, spec.scale), config, tokens, positions))
    assert np.abs(want - np.asarray(forward(params, config, tokens, positions))).max() > 1e-2
    np.testing.assert_allclose(np.asarray(forward(seen["params"], config, tokens, positions)), want, atol=1e-5)


def test_an_adapter_for_another_model_is_one_clear_error(converted, tmp_path, capsys):
    from jaxrl_llm.models import ModelConfig, lora
    from jaxrl_llm.models.peft_io import save_peft

    other = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    spec = lora.LoraSpec(rank=2, alpha=2.0, targets=("q_proj",))
    save_peft(tmp_path / "other", spec, lora.init_adapters(other, spec, jax.random.PRNGKey(0)))
    assert main(["sample", "--model", str(converted), "--adapter", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "jaxrl-llm sample: error: " in err and "q_proj.lora_A.weight" in err and "expected" in err
    assert main(["sample", "--model", str(converted), "--adapter", str(tmp_path / "nowhere")]) == 2
    assert "adapter_config.json: missing" in capsys.readouterr().err


def test_train_with_an_int8_base_exports_the_quantized_base_plus_adapters(converted, tmp_path):
    from jaxrl_llm.models import lora, quant
    from jaxrl_llm.models.peft_io import load_peft

    run_dir = tmp_path / "run"
    overrides = [f"model.source={converted}", "data.prompt=raw", "train.steps=1", "train.eval_problems=0",
                 "sampling.prompts_per_step=2", "sampling.samples_per_prompt=2", "sampling.max_new_tokens=4",
                 "optim.micro_batch_size=4", "optim.lr=1e-2", "algorithm.entropy_coef=1.0", "lora.rank=2",
                 "lora.base_dtype=int8",
                 f"train.out_dir={run_dir}"]
    assert main(["train", *overrides]) == 0
    config, base = load_hf(converted)
    spec, adapters = load_peft(run_dir / "final_adapter", config)
    assert np.abs(np.asarray(adapters["layers"]["q_proj_lora_b"])).max() > 0  # the entropy bonus moved them
    # final/ is the int8-coded base, dequantized, plus s A B: not the float32 base plus s A B.
    want = lora.merge(quant.quantize_base(base, "int8"), adapters, spec.scale)
    _, exported = load_hf(run_dir / "final")
    for name in lora.PROJECTIONS:
        np.testing.assert_allclose(np.asarray(exported["layers"][name]), np.asarray(want["layers"][name]),
                                   atol=1e-6, err_msg=name)
    unquantized = lora.merge(base, adapters, spec.scale)["layers"]["gate_proj"]
    assert np.abs(np.asarray(exported["layers"]["gate_proj"]) - np.asarray(unquantized)).max() > 1e-5
