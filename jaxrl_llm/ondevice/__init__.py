"""The whole RL iteration on the accelerator: sampling, an on-device integer reward and the update in one
`lax.scan` (`fused`, `device_reward`), for benchmarks and for tasks whose reward is exact integer matching."""
