"""What a train step's forward and backward passes hold per device: the activations kept for the backward pass, the
backward pass's largest working set, and the log-prob pass's residuals (the formulas of `capacity.memory`'s
docstring, train step)."""

from __future__ import annotations

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling.buckets import round_up

LOGPROB_CHUNK = 8192  # vocabulary chunk of train.logprobs.chunked_logprobs


def split_features(n: int, ways: int) -> int:
    """`n` features per device: split over `ways` devices (a mesh axis) where it divides them (`models.sharding`),
    else whole."""
    return n // ways if n % ways == 0 else n


def padded_tile_rows(pairs: int, experts: int) -> int:
    """Rows of the tiled grouped matmul's padded buffer (`models.moe`'s tiles path, a CPU's): t (ceil(M / t)
    + min(E, M)) for M (token, expert) pairs over E experts, t = `moe.tile_rows(M, E)`, the power of two at or
    above M / E in [8, 128]."""
    tile = _tile(pairs, experts)
    return tile * (-(-pairs // tile) + min(experts, pairs))


def _tile(pairs: int, experts: int) -> int:
    """`models.moe.tile_rows`: rows per tile, the power of two at or above pairs / experts, in [8, 128]."""
    mean = -(-pairs // experts)
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def feed_forward_bytes(mc: ModelConfig, tokens: int, tensor: int, c: int, sparse: bool,
                       tiles: bool = False, expert: int = 1, gathered: int = 1) -> tuple[int, int]:
    """(forward, gradients) of one layer's feed-forward block on `tokens` tokens of a device, F split over tensor
    where it divides it. Dense: gate, up, SiLU(gate) and their product, 4 F x c a token; while its backward runs,
    the gradients of gate and up, 2 F x c. Sparse (a mixture of experts, `models.moe`; E experts, k per token,
    width F_e): the router's f32 logits E x 4 and the chosen ids and weights k x 8, the (token, expert) rows
    sorted by expert k D x c, the grouped matmuls' gate, up, SiLU and product 4 M F_e x c over its M = N k rows,
    their outputs k D x c and each token's k outputs in f32 k D x 4. With the CPU's tiles (`tiles`: a scan over
    T tiles of t rows, P = T t = `padded_tile_rows`) the hidden is the scan's per-tile residuals instead,
    P x 6 F_e x c, beside each tile's slices of the three matrices, 3 T D F_e x c, and the padded rows in and out,
    2 P D x c (XLA's CPU buffer assignment). Its backward: the gradients of the grouped rows, gate and up,
    M (D + 2 F_e) x c (tiles: + the padded rows' two gradients, 2 P D x c). Over an `expert` axis of s > 1 devices
    (`models.expert_parallel`'s worst-case buffers) a device's grouped rows are M = s C, C = N min(k, E / s): the
    received rows and their outputs, 2 s C D x c, beside its own N k sorted rows and returned outputs, 2 N k D x c
    (`jaxrl-llm compile`, Qwen3-30B-A3B's first 4 layers on v5p-64, expert=8,tensor=4: XLA's peak 34.83 GiB, this
    estimate 34.6; counting the send and returned buffers as s C rows too, 48.6). Without an expert axis,
    on `gathered` = data x fsdp devices, XLA's SPMD partitioner cannot split the grouped rows (their groups are the
    experts' runs of every token): it gathers every device's pairs, M = N k x gathered, and the sorted rows and
    outputs, hidden and gradients are that many rows on every device (`jaxrl-llm compile`, Qwen3-30B-A3B on v5p-64,
    fsdp=8: a bf16 [1835008, 2048] buffer, 8 x 229,376 pairs)."""
    d = mc.hidden_size
    if not sparse:
        f = split_features(mc.intermediate_size, tensor)
        return tokens * 4 * f * c, tokens * 2 * f * c
    k, f, experts = mc.num_experts_per_tok, split_features(mc.expert_intermediate_size, tensor), mc.num_experts
    routed = tokens * (experts * 4 + k * 8 + k * d * 4)
    if expert > 1:
        experts //= expert
        grouped = expert * tokens * min(k, experts)
        routed += 2 * tokens * k * d * c + 2 * grouped * d * c
    else:
        grouped = tokens * k * gathered
        routed += 2 * grouped * d * c
    grads = grouped * (d + 2 * f) * c
    if not tiles:
        return routed + grouped * 4 * f * c, grads
    padded = padded_tile_rows(grouped, experts)
    hidden = padded * 6 * f * c + 3 * (padded // _tile(grouped, experts)) * d * f * c
    return routed + hidden + 2 * padded * d * c, grads + 2 * padded * d * c


def activation_bytes(mc: ModelConfig, rows: int, length: int, tensor: int, c: int, remat: bool,
                      policy: str = "full", block: int | None = None,
                      groups: tuple[int, int, bool] | None = None, tiles: bool = False,
                      expert: int = 1, gathered: int = 1) -> tuple[int, int]:
    """(kept, working) for `rows` sequences of `length` tokens on a mesh whose tensor axis has `tensor` devices:
    what the forward pass keeps for the backward pass, and the largest working set of the backward pass beside
    it (one layer's recomputed activations, its attention's working set and gradients; or, at the embedding,
    the hidden states' f32 gradient twice). Remat policy "dots" also keeps each layer's projection outputs
    (q, k, v, o, gate, up, down) per token, "qkv_attn_mlp" q, k, v, the attention output, gate and up; `block`
    is model.attention_block_size (None: full attention); `groups` (S, W, dense): a fused kernel attends on S
    regrouped rows of W tokens per row (`models.attention`), or with `dense` XLA's full attention on each of
    them (a GPU where cuDNN cannot serve); None: the xla path."""
    q_heads = split_features(mc.num_heads, tensor)
    q, kv = q_heads * mc.head_dim, split_features(mc.num_kv_heads, tensor) * mc.head_dim
    d, tokens = mc.hidden_size, rows * length
    # Per layer: norm inputs/outputs, q/k/v before and after RoPE, attention output, residuals, and the layer's
    # feed-forward block (`feed_forward_bytes`: the dense MLP, or a sparse layer's experts and routing buffers).
    blocks = {sparse: feed_forward_bytes(mc, tokens, tensor, c, sparse, tiles, expert, gathered)
              for sparse in set(mc.sparse_layers())}
    per_layer = {sparse: tokens * (4 * d + 2 * q + 3 * kv) * c + fwd for sparse, (fwd, _) in blocks.items()}
    # While one layer's backward pass runs: the gradients of its input, output, q, k, v and its block's.
    layer_grads = {sparse: tokens * (2 * d + q + 2 * kv) * c + grads for sparse, (_, grads) in blocks.items()}
    # The hidden states' f32 gradient where the embedding is differentiated, twice (resharded for its gradient).
    embed_grads = tokens * d * 4 * 2
    attention, working = _attention_bytes(mc, rows, length, tensor, c, block, groups)
    layers = mc.sparse_layers()
    if remat:
        kept = 0
        for sparse in layers:
            # what a remat policy keeps of the block: gate and up, per choice in a sparse layer
            f = (mc.num_experts_per_tok * split_features(mc.expert_intermediate_size, tensor) if sparse
                 else split_features(mc.intermediate_size, tensor))
            kept += d + {"dots": q + 2 * kv + 2 * d + 2 * f, "qkv_attn_mlp": 2 * q + 2 * kv + 2 * f}.get(policy, 0)
            if policy == "qkv_attn_mlp":  # the layer being differentiated recomputes its norm outputs and block
                per_layer[sparse] = tokens * (2 * d + 2 * f) * c if not sparse else \
                    tokens * 2 * d * c + blocks[sparse][0]
        layer = max(per_layer[s] + layer_grads[s] for s in blocks)
        if len(blocks) > 1:  # dense and sparse layers mixed: the layer's lax.cond holds both branches' buffers
            layer = per_layer[True] + layer_grads[True] + sum(blocks[False])
        return tokens * kept * c, max(layer + attention + working, embed_grads)
    return (sum(per_layer[sparse] + attention for sparse in layers),
            max(working + max(layer_grads.values()), embed_grads))


def _attention_bytes(mc: ModelConfig, rows: int, length: int, tensor: int, c: int, block: int | None,
                     groups: tuple[int, int, bool] | None) -> tuple[int, int]:
    """(kept per layer, backward working set) of one layer's attention on `rows` rows of `length` tokens: the
    fused kernel's regrouped rows (`groups`), full attention's scores (`block` None), or blockwise tiles."""
    q_heads = split_features(mc.num_heads, tensor)
    if groups is not None:
        # the kernel runs per device on its KV heads' query groups, all heads where tensor cannot split the KV
        # heads: q, its output and output gradient, k and v, all in c (splash's backward kernels give dq, dk,
        # dv in the inputs' dtype), and the int32 segment ids laid over 128 lanes (512 B a token)
        slots, width, dense = groups
        kv_heads = split_features(mc.num_kv_heads, tensor)
        heads = kv_heads * (mc.num_heads // mc.num_kv_heads)
        tokens = rows * slots * width
        attention = 0
        working = tokens * (mc.head_dim * (heads * 3 * c + kv_heads * 2 * c) + 512)
        if dense:  # each regrouped row's scores and probabilities, as the xla path's full attention per row
            attention = rows * slots * heads * width * width * (4 + c)
            working += rows * slots * (heads * width * width * 4 + width * width)
        return attention, working
    if block is None:
        return (rows * q_heads * length * length * (4 + c),
                rows * q_heads * length * length * 4 + rows * length * length)  # f32 score gradient + bool mask
    tile = min(block, length)
    return 0, (rows * q_heads * round_up(length, tile) * (mc.head_dim + 2) * 4  # per key block: max, sum, out
               + rows * q_heads * tile * tile * (12 + c) + rows * tile * tile)  # one tile, its gradient, mask


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
