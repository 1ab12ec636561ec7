"""Capacity planning, with no training in it: what a config holds in each chip's memory (`memory`, the
closed-form estimate), the programs compiled for a TPU slice or GPU host without the hardware (`aot`, behind
`jaxrl-llm compile`), the GPU targets (`gpu_targets`) and what a compiled program executes (`hlo_stats`)."""
