"""Pack each prompt's responses into one training row: [prompt | response 1 | response 2 | ...].

The samples of one prompt share it, so a row holds the prompt once and every kept response after it;
each response restarts its positions where the prompt ends and attends only to the prompt and to
itself (segment ids, see `models.hidden_states`). Its log-probs and gradients are exactly those of
the unpacked rows, at a fraction of the tokens: with a 100-token prompt and 8 responses of 20 tokens,
260 tokens instead of 960.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class TrainBatch(NamedTuple):
    """G packed rows of up to S responses each, R tokens per response. Padding has mask 0."""

    tokens: np.ndarray  # [G, L] int32: prompt, then the responses back to back, then padding
    positions: np.ndarray  # [G, L] int32
    segments: np.ndarray  # [G, L] int32: 0 prompt, s + 1 response slot s, S + 1 padding
    pred_index: np.ndarray  # [G, S, R] int32: where in the row the hidden state predicting token r sits
    response_tokens: np.ndarray  # [G, S, R] int32
    mask: np.ndarray  # [G, S, R] float32: 1 on generated tokens
    advantages: np.ndarray  # [G, S, R] float32
    old_logp: np.ndarray  # [G, S, R] float32: behaviour-policy log-probs
    ref_logp: np.ndarray  # [G, S, R] float32: reference-policy log-probs (zeros when unused)
    old_values: np.ndarray  # [G, S, R] float32: the critic's values at scoring time (zeros without a critic)
    returns: np.ndarray  # [G, S, R] float32: the critic's regression targets (zeros without a critic)
    # distill.mode topk only (else None, so other runs' programs take no such inputs): the teacher's K most likely
    # ids at each response position and its full-vocabulary log-probs of them
    teacher_ids: np.ndarray | None = None  # [G, S, R, K] int32
    teacher_topk_logp: np.ndarray | None = None  # [G, S, R, K] float32
    # a mixture of experts' sampled routes (routing replay; else None): the experts the sampler chose for the token
    # at each position of the row in each sparse layer, -1 where it recorded none (padding, a response's last token)
    routes: np.ndarray | None = None  # [G, L, L_sparse, k] small ints (`models.moe.route_dtype`)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(n: int, multiple: int = 1) -> int:
    """A multiple of `multiple` holding n, with a power-of-two number of multiples (few distinct shapes,
    so few compilations of the train step)."""
    chunks = max(1, -(-n // multiple))
    return multiple * (1 << (chunks - 1).bit_length())


def length_bucket(n: int, multiple: int) -> int:
    """A multiple of `multiple` holding n, on a grid of four sizes per doubling (chunk counts 1..4, then
    5,6,7,8, 10,12,14,16, 20,...): at most 25% padding, and few distinct row lengths when group sizes vary
    from step to step (GVM), so the train step compiles a handful of times, not once per step."""
    chunks = max(1, -(-n // multiple))
    step = 1 << max(0, chunks.bit_length() - 3)
    return multiple * round_up(chunks, step)


def pack_groups(prompts: Sequence[Sequence[int]], groups: Sequence[np.ndarray], responses: np.ndarray,
                lengths: np.ndarray, *, advantages: np.ndarray | None = None, old_logp: np.ndarray | None = None,
                ref_logp: np.ndarray | None = None, old_values: np.ndarray | None = None,
                returns: np.ndarray | None = None, masks: np.ndarray | None = None, pad_id: int = 0,
                row_multiple: int = 1, seq_multiple: int = 32, teacher_ids: np.ndarray | None = None,
                teacher_topk_logp: np.ndarray | None = None, routes: np.ndarray | None = None,
                prompt_routes: np.ndarray | None = None) -> TrainBatch:
    """Pack samples into rows: row g holds prompts[g] then the responses `groups[g]` (indices into
    `responses` [N, R] with `lengths` [N]). Per-token arrays [N, R] (advantages, old/ref log-probs, the
    critic's old values and returns) are laid out like the responses; absent ones are zeros. `masks` [N, R]:
    the loss mask of each response's tokens (a multi-turn sample's tool output is 0); None: 1 on all n tokens.
    `teacher_ids` / `teacher_topk_logp` [N, R, K] (top-K distillation, both or neither) are laid out the same way,
    [G, S, R, K]; absent, the batch's fields are None. `routes` [N, R, L_sparse, k] and `prompt_routes`
    [N, P, L_sparse, k] (routing replay: the sampler's experts of each response's and each sample's prompt tokens,
    -1 where none) become the batch's routes [G, L, L_sparse, k], a row's prompt taking its first sample's. Empty groups
    are skipped. The row count is padded to `bucket(., row_multiple)`, the response slots to a power of
    two, the length to
    `length_bucket(., seq_multiple)`.
    """
    resp_len = responses.shape[1]
    rows = [(p, np.asarray(g, np.int64)) for p, g in zip(prompts, groups) if len(g)]
    if not rows:
        raise ValueError("pack_groups: every group is empty")
    n_rows = bucket(len(rows), row_multiple)
    slots = bucket(max(len(g) for _, g in rows))
    seq_len = length_bucket(max(len(p) + int(lengths[g].sum()) for p, g in rows), seq_multiple)
    zeros = np.zeros(responses.shape, np.float32)
    per_token = {"advantages": advantages, "old_logp": old_logp, "ref_logp": ref_logp, "old_values": old_values,
                 "returns": returns}
    per_token = {k: zeros if v is None else np.asarray(v, np.float32) for k, v in per_token.items()}

    tokens = np.full((n_rows, seq_len), pad_id, np.int32)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (n_rows, 1))
    segments = np.full((n_rows, seq_len), slots + 1, np.int32)
    pred_index = np.zeros((n_rows, slots, resp_len), np.int32)
    out = {k: np.zeros((n_rows, slots, resp_len), np.float32) for k in ("mask", *per_token)}
    response_tokens = np.zeros((n_rows, slots, resp_len), np.int32)
    topk = {}
    if teacher_ids is not None:
        k = teacher_ids.shape[-1]
        topk = {"teacher_ids": (np.asarray(teacher_ids, np.int32), np.zeros((n_rows, slots, resp_len, k), np.int32)),
                "teacher_topk_logp": (np.asarray(teacher_topk_logp, np.float32),
                                      np.zeros((n_rows, slots, resp_len, k), np.float32))}
    packed_routes = None
    if routes is not None:
        packed_routes = np.full((n_rows, seq_len, *routes.shape[2:]), -1, routes.dtype)
    for row, (prompt, members) in enumerate(rows):
        start = len(prompt)
        tokens[row, :start] = prompt
        if packed_routes is not None:
            packed_routes[row, :start] = prompt_routes[members[0], :start]
        segments[row, :start] = 0
        for slot, i in enumerate(members):
            n = int(lengths[i])
            tokens[row, start:start + n] = responses[i, :n]
            positions[row, start:start + n] = len(prompt) + np.arange(n)
            segments[row, start:start + n] = slot + 1
            # token 0 is predicted by the prompt's last position, token t by the response's token t - 1
            pred_index[row, slot, :n] = np.concatenate([[len(prompt) - 1], start + np.arange(n - 1)])
            response_tokens[row, slot, :n] = responses[i, :n]
            out["mask"][row, slot, :n] = 1.0 if masks is None else masks[i, :n]
            for key, values in per_token.items():
                out[key][row, slot, :n] = values[i, :n]
            for values, packed in topk.values():
                packed[row, slot, :n] = values[i, :n]
            if packed_routes is not None:
                packed_routes[row, start:start + n] = routes[i, :n]
            start += n
        positions[row, start:] = len(prompt)  # padding: harmless positions inside its own segment
    return TrainBatch(tokens=tokens, positions=positions, segments=segments, pred_index=pred_index,
                      response_tokens=response_tokens, **out, **{k: packed for k, (_, packed) in topk.items()},
                      routes=packed_routes)


def micro_batch_order(rows: int, micro_batch_size: int) -> np.ndarray:
    """Row order [rows] under which `train.step.split_micro` (slot t of micro-batch j is row t n + j, n = rows /
    micro_batch_size) makes micro-batch j of rows j m .. j m + m - 1 (m = micro_batch_size): `batch[order]` keeps
    the packer's trailing padding rows together in whole micro-batches at the end, which the train step skips,
    instead of one in every micro-batch. Entry p is the packed row placed at position p."""
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows are not a multiple of micro_batch_size={micro_batch_size}")
    index = np.arange(rows)
    order = np.empty(rows, np.int64)
    order[(index % micro_batch_size) * (rows // micro_batch_size) + index // micro_batch_size] = index
    return order


def unpack(values: np.ndarray, groups: Sequence[np.ndarray], num_samples: int) -> np.ndarray:
    """Inverse of the packing layout: [G, S, R, ...] per-slot values -> [N, R, ...] per sample (zeros for samples
    in no group)."""
    out = np.zeros((num_samples, *values.shape[2:]), values.dtype)
    row = 0
    for members in groups:
        if len(members):
            out[np.asarray(members)] = values[row, :len(members)]
            row += 1
    return out
