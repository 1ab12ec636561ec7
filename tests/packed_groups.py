"""Random prompt groups for the packing, train-step and PPO tests: prompts of varied length, each with a few
responses of varied length, as `pack_groups` takes them."""

from __future__ import annotations

import numpy as np


def random_groups(vocab_size: int, *, groups: int = 4, per_group: int = 3, resp: int = 6, seed: int = 0):
    """(prompts, members, responses [n, resp] int32, lengths [n], mask [n, resp] f32, rng): `groups` prompts
    of 2-6 token ids in [1, vocab_size), `per_group` responses each of 1..resp tokens, members[g] the
    response indices of group g; `rng` is the generator after these draws, for any further ones."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab_size, size=rng.integers(2, 7)).tolist() for _ in range(groups)]
    n = groups * per_group
    responses = rng.integers(1, vocab_size, size=(n, resp)).astype(np.int32)
    lengths = rng.integers(1, resp + 1, size=n)
    members = [np.arange(g * per_group, (g + 1) * per_group) for g in range(groups)]
    mask = (np.arange(resp)[None] < lengths[:, None]).astype(np.float32)
    return prompts, members, responses, lengths, mask, rng
