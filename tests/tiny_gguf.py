"""Tiny GGUF files written in the tests with gguf.GGUFWriter, laid out the way llama.cpp writes them.

    tensors, config = write_tiny_gguf(path, "llama")   # HF-layout tensors the file must round-trip to

The vocabulary is GPT-2's 256 byte symbols, three ChatML control tokens in front and a few merges
("Ġ t" -> "Ġt", "h e" -> "he", "Ġt he" -> "Ġthe", "1 2" -> "12"), so token ids can be worked out by hand.
Llama q/k rows are written interleaved per head, as llama.cpp's converter does; Qwen files are not.
"""

from __future__ import annotations

import pathlib

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "1 2")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 48, 2


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order: printable Latin-1 bytes stand for
    themselves, the other bytes take the characters from U+0100 on, in order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in keep:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def tiny_vocab() -> list[str]:
    merged = ["".join(pair.split(" ")) for pair in MERGES]
    return [*SPECIAL_TOKENS, *byte_symbols(), *merged]


def llama_cpp_interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """Row order llama.cpp writes for Llama q/k: within each head of d rows, row 2i holds HF row i and
    row 2i + 1 holds HF row d/2 + i (the two RoPE halves interleaved)."""
    d = weight.shape[0] // heads
    order = []
    for h in range(heads):
        for i in range(d // 2):
            order += [h * d + i, h * d + d // 2 + i]
    return weight[np.array(order)]


def tiny_hf_tensors(arch: str, *, tied: bool, seed: int = 0, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Random float32 HF-named tensors ([out, in]) of a tiny model of `arch` (default vocabulary: tiny_vocab())."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()) if vocab_size is None else vocab_size

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, HIDDEN, scale=1.0), "model.norm.weight": 1 + w(HIDDEN)}
    if not tied:
        t["lm_head.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = 1 + w(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = w(FFN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = w(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = w(HIDDEN, FFN)
        if arch == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                t[p + f"self_attn.{proj}_proj.bias"] = w(rows * HEAD_DIM)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + w(HEAD_DIM)
            t[p + "self_attn.k_norm.weight"] = 1 + w(HEAD_DIM)
    return t


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def write_tiny_gguf(path, arch: str = "llama", *, tied: bool = False, seed: int = 0, float16: bool = False,
                    rope_theta: float = 10000.0, add_bos: bool = False, tensors=None, pre: str = "default",
                    sentencepiece=None):
    """Write a tiny `arch` GGUF at `path`; returns the HF-layout float32 tensors it encodes.

    `float16` stores every matrix as F16 (the returned tensors are then the F16-rounded values);
    `tensors` replaces the random weights (HF names) when given; `sentencepiece` (a folder with a
    tokenizer.model, see `train_sentencepiece`) writes that vocabulary instead of the byte-level one."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if sentencepiece is None:
        vocab_size = _add_byte_level_vocab(writer, pre=pre, add_bos=add_bos)
    else:
        vocab_size = _add_sentencepiece_vocab(writer, sentencepiece, add_bos=add_bos)
    if tensors is None:
        tensors = tiny_hf_tensors(arch, tied=tied, seed=seed, vocab_size=vocab_size)
    tensors = dict(tensors)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, value in tensors.items():
        stored = value
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            stored = llama_cpp_interleave(value, HEADS if "q_proj" in name else KV_HEADS)
        if float16 and value.ndim == 2:
            stored = stored.astype(np.float16)
            tensors[name] = value.astype(np.float16).astype(np.float32)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def _add_byte_level_vocab(writer, *, pre: str, add_bos: bool) -> int:
    """tiny_vocab() as a byte-level BPE with MERGES and a ChatML template; returns the vocabulary size."""
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_types([3 if tok in SPECIAL_TOKENS else 1 for tok in vocab])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)
    return len(vocab)


def expected_hf_config(arch: str, *, tied: bool, rope_theta: float = 10000.0) -> dict:
    """The config.json values a tiny file of `arch` must give."""
    return {
        "model_type": arch, "vocab_size": len(tiny_vocab()), "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rope_theta": rope_theta, "tie_word_embeddings": tied,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    }


def tiny_gguf_path(tmp_path, arch: str = "llama", **kw) -> pathlib.Path:
    path = pathlib.Path(tmp_path) / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, **kw)
    return path


def rewrite_gguf(source, target, *, replace=None, extra=None) -> None:
    """Copy GGUF `source` to `target` (same metadata and tensors), storing `replace[name] =
    (raw_array, ggml_type)` instead of a tensor's data and appending `extra[name] = float32 array`."""
    import gguf

    from jaxrl_llm.models.gguf import read_gguf_metadata

    replace, extra = replace or {}, extra or {}
    values = read_gguf_metadata(source)
    reader = gguf.GGUFReader(str(source))  # for the value types
    writer = gguf.GGUFWriter(str(target), values["general.architecture"])
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, values[key], field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name in replace:
            raw, ggml_type = replace[tensor.name]
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=ggml_type)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, value in extra.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SPM_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Let's think step by step and output the final answer within \\boxed{}.",
    "x = 12345678 + 9.75 - 1,000,000.00",
    "What is 7 + 5? The answer is 12. [INST] Solve it. [/INST]",
    "  leading\n\n\ttabs   and  spaces",
)


def train_sentencepiece(directory, vocab_size: int = 400) -> pathlib.Path:
    """Train a SentencePiece BPE model with Llama 2's settings (byte fallback, split digits, no
    normalisation, a dummy prefix, whitespace kept) on a small corpus; returns tokenizer.model's folder."""
    import sentencepiece

    folder = pathlib.Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 20), model_prefix=str(folder / "tokenizer"), model_type="bpe",
        vocab_size=vocab_size, hard_vocab_limit=False, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, character_coverage=1.0, minloglevel=2)
    return folder


def _add_sentencepiece_vocab(writer, model_folder, *, add_bos: bool | None = None, scores: bool = True) -> int:
    """The vocabulary of `model_folder`/tokenizer.model: its tokens, scores and token types as llama.cpp's
    converter reads them (gguf.vocab.SentencePieceVocab); returns the vocabulary size."""
    from gguf.vocab import SentencePieceVocab

    tokens, token_scores, types = zip(*SentencePieceVocab(pathlib.Path(model_folder)).all_tokens())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t.decode("utf-8") for t in tokens])
    if scores:
        writer.add_token_scores(list(token_scores))
    writer.add_token_types([int(t) for t in types])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_space_prefix(True)
    return len(tokens)


def write_sentencepiece_gguf(path, model_folder, *, add_bos: bool | None = None, scores: bool = True) -> None:
    """A GGUF holding only the SentencePiece vocabulary of `model_folder` (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    _add_sentencepiece_vocab(writer, model_folder, add_bos=add_bos, scores=scores)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
