"""What a train step's forward and backward passes hold per device: the activations kept for the backward pass, the
backward pass's largest working set, and the log-prob pass's residuals (the formulas of `capacity.memory`'s
docstring, train step)."""

from __future__ import annotations

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling.buckets import round_up

LOGPROB_CHUNK = 8192  # vocabulary chunk of train.logprobs.chunked_logprobs


def _split(n: int, tensor: int) -> int:
    """`n` features per device: split over tensor where it divides them (`models.sharding`), else whole."""
    return n // tensor if n % tensor == 0 else n


def activation_bytes(mc: ModelConfig, rows: int, length: int, tensor: int, c: int, remat: bool,
                      policy: str = "full", block: int | None = None,
                      groups: tuple[int, int, bool] | None = None) -> tuple[int, int]:
    """(kept, working) for `rows` sequences of `length` tokens on a mesh whose tensor axis has `tensor` devices:
    what the forward pass keeps for the backward pass, and the largest working set of the backward pass beside
    it (one layer's recomputed activations, its attention's working set and gradients; or, at the embedding,
    the hidden states' f32 gradient twice). Remat policy "dots" also keeps each layer's projection outputs
    (q, k, v, o, gate, up, down) per token, "qkv_attn_mlp" q, k, v, the attention output, gate and up; `block`
    is model.attention_block_size (None: full attention); `groups` (S, W, dense): a fused kernel attends on S
    regrouped rows of W tokens per row (`models.attention`), or with `dense` XLA's full attention on each of
    them (a GPU where cuDNN cannot serve); None: the xla path."""
    q_heads = _split(mc.num_heads, tensor)
    q, kv = q_heads * mc.head_dim, _split(mc.num_kv_heads, tensor) * mc.head_dim
    f = _split(mc.intermediate_size, tensor)
    d = mc.hidden_size
    per_layer_tokens = rows * length * (4 * d + 2 * q + 3 * kv + 4 * f) * c
    # While one layer's backward pass runs: the gradients of its input, output, q, k, v, gate and up.
    layer_grads = rows * length * (2 * d + q + 2 * kv + 2 * f) * c
    # The hidden states' f32 gradient where the embedding is differentiated, twice (resharded for its gradient).
    embed_grads = rows * length * d * 4 * 2
    if groups is not None:
        # the kernel runs per device on its KV heads' query groups, all heads where tensor cannot split the KV
        # heads: q, its output and output gradient, k and v, all in c (splash's backward kernels give dq, dk,
        # dv in the inputs' dtype), and the int32 segment ids laid over 128 lanes (512 B a token)
        slots, width, dense = groups
        kv_heads = _split(mc.num_kv_heads, tensor)
        heads = kv_heads * (mc.num_heads // mc.num_kv_heads)
        tokens = rows * slots * width
        attention = 0
        working = tokens * (mc.head_dim * (heads * 3 * c + kv_heads * 2 * c) + 512)
        if dense:  # each regrouped row's scores and probabilities, as the xla path's full attention per row
            attention = rows * slots * heads * width * width * (4 + c)
            working += rows * slots * (heads * width * width * 4 + width * width)
    elif block is None:
        attention = rows * q_heads * length * length * (4 + c)
        working = rows * q_heads * length * length * 4 + rows * length * length  # f32 score gradient + bool mask
    else:
        tile = min(block, length)
        attention = 0
        working = (rows * q_heads * round_up(length, tile) * (mc.head_dim + 2) * 4  # per key block: max, sum, out
                   + rows * q_heads * tile * tile * (12 + c) + rows * tile * tile)  # one tile, its gradient, mask
    if remat:
        kept = d
        if policy == "dots":
            kept += q + 2 * kv + 2 * d + 2 * f
        elif policy == "qkv_attn_mlp":
            kept += 2 * q + 2 * kv + 2 * f
            # the layer being differentiated recomputes only its two norm outputs and SiLU(gate) x up
            per_layer_tokens = rows * length * (2 * d + 2 * f) * c
        return (mc.num_layers * rows * length * kept * c,
                max(per_layer_tokens + attention + working + layer_grads, embed_grads))
    return mc.num_layers * (per_layer_tokens + attention), max(working + layer_grads, embed_grads)


def logprob_residual_bytes(mc: ModelConfig, rows: int, response_tokens: int, c: int, keep_logits: bool,
                            head_elements: int) -> int:
    """What the custom VJP of `chunked_logprobs` needs per token: the hidden state in c, the int32 target,
    log Z and E_p[logit] in f32, and either every vocabulary chunk's f32 logits (kept) or, recomputing them,
    one chunk's f32 logits at a time. Kept logits: plus the backward pass's pieces of d head
    (`head_elements` x c, concatenated at the end)."""
    # plus one chunk's logits in c as the matmul gives them, before the f32 cast
    per_token = mc.hidden_size * c + 12 + (min(mc.vocab_size, LOGPROB_CHUNK) * c if c != 4 else 0)
    if keep_logits:
        return rows * response_tokens * (per_token + mc.vocab_size * 4) + head_elements * c
    return rows * response_tokens * (per_token + min(mc.vocab_size, LOGPROB_CHUNK) * 4)
