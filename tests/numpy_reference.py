"""NumPy reference computations the model tests compare against."""

import numpy as np


def numpy_attention(q, k, v, keep):
    """softmax(q k^T / sqrt(d), masked to `keep`) v in float64, query head h reading KV head h // (H / KV).
    q [B, T, H, d], k and v [B, S, KV, d], keep [B, T, S] bool -> [B, T, H * d]."""
    heads, kv_heads = q.shape[2], k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        scores = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kh]) / np.sqrt(q.shape[-1])
        scores = np.where(keep, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, :, h] = np.einsum("bts,bsd->btd", probs / probs.sum(-1, keepdims=True), v[:, :, kh])
    return out.reshape(q.shape[0], q.shape[1], -1)
