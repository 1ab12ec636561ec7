"""Capacity planning, with no training in it: the chips and slices it plans for (`chips`, one table), what a config
holds in each chip's memory (`memory`, the closed-form estimate, from `elements`, `activations` and `known_models`;
`layouts`, the layout of least estimated peak), the programs compiled for a TPU slice or GPU host without the
hardware (`aot`, behind `jaxrl-llm compile`, on `topology`'s devices, each program's `report`), the GPU targets
(`gpu_targets`) and what a compiled program executes (`hlo_stats`). The step's shapes they count and compile are
`run.shapes`'."""
