"""Run plumbing around the RL loop: the config (`config`), building a run from it (`setup`), where its arrays
live (`layout`), the train state and optimizer (`state`), checkpoints and exact resume (`checkpoint`, `resume`),
and the metrics it writes (`metrics`)."""
