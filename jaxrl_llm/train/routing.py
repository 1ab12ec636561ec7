"""Routing statistics of a mixture of experts' training pass against the sampler's routes (issue 57, part 4).

Plain arrays in, arrays out: `routes_changed` (how often the trainer's own top-k differs from the sampler's),
`load_max_over_mean` (how unevenly the experts are loaded) and `load_balancing_loss` (Switch Transformer's
auxiliary loss, Fedus et al. 2022, eq. 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def routes_changed(own: jax.Array, recorded: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(changed, recorded) counts over (token, layer) routes: own [..., k] the trainer's top-k experts, recorded
    [..., k] the sampler's (-1: none). A route changed when the two sets differ (order ignored); only routes with a
    record count. changed / recorded is the metric `routes_changed`."""
    has = recorded[..., 0] >= 0
    differ = jnp.any(jnp.sort(own.astype(jnp.int32), -1) != jnp.sort(recorded.astype(jnp.int32), -1), axis=-1)
    return jnp.sum(differ & has).astype(jnp.float32), jnp.sum(has).astype(jnp.float32)


def load_max_over_mean(load: jax.Array) -> jax.Array:
    """Mean over layers of max_e load_e / mean_e load_e, load [L_sparse, E] the (token, expert) assignments per
    expert: 1 when every expert takes the same share, E / k when each token's k experts are always the same."""
    load = jax.lax.stop_gradient(load)
    mean = jnp.maximum(load.mean(-1), 1e-9)
    return jnp.mean(load.max(-1) / mean)


def load_balancing_loss(load: jax.Array, prob_sum: jax.Array) -> jax.Array:
    """Switch Transformer's load-balancing loss, mean over layers of E sum_e f_e P_e (Fedus et al. 2022, eq. 4):
    f_e = load_e / sum load, the fraction of (token, expert) assignments to expert e (no gradient), and
    P_e = prob_sum_e / sum prob_sum, the mean router probability of e. load, prob_sum [L_sparse, E]; 1 when
    balanced."""
    load = jax.lax.stop_gradient(load)
    num_experts = load.shape[-1]
    f = load / jnp.maximum(load.sum(-1, keepdims=True), 1e-9)
    p = prob_sum / jnp.maximum(jax.lax.stop_gradient(prob_sum).sum(-1, keepdims=True), 1e-9)
    return jnp.mean(num_experts * jnp.sum(f * p, axis=-1))
