"""The step's shapes (`run.shapes.step_shapes`), each figure computed by hand from the packing, bucket and chunk
rules: what setup, the memory estimate and the compiler all read."""

import pytest

from jaxrl_llm.run.config import load_config
from jaxrl_llm.run.shapes import mesh_sizes, parse_mesh, step_shapes

TINY = ["data.max_prompt_tokens=8", "sampling.max_new_tokens=8", "sampling.samples_per_prompt=2",
        "sampling.prompts_per_step=2", "optim.micro_batch_size=2", "optim.mini_batches=1", "algorithm.kl_coef=0"]
FSDP2 = {"data": 1, "fsdp": 2, "expert": 1, "tensor": 1}


def test_a_plain_step_by_hand():
    """2 prompts x 2 samples, prompts of at most 8 tokens and 8 new tokens, on fsdp=2: a packed row holds a prompt's
    2 responses, 8 + 2 x 8 = 24 tokens on the packer's grid of 32; one row per device; the sampler's one call has
    4 rows (a power of two, a multiple of 2), prompts bucketed to 16 tokens, responses to 16, 2 prompts per
    prefill, and each prompt entry serves its 2 rows on a device."""
    s = step_shapes(load_config(None, TINY), FSDP2)
    assert (s.responses_per_row, s.response_tokens, s.row_length) == (2, 8, 32)
    assert (s.rows_per_device, s.mini_batch_rows, s.row_split) == (1, 2, 2)
    assert (s.samples_per_prompt, s.sampler_samples, s.varying_counts) == (2, 2, False)
    call = s.sampler_call.shapes
    assert (call.row_bucket, call.prompt_bucket, call.new_token_bucket, call.prompts_per_prefill) == (4, 16, 16, 2)
    assert s.prompt_group == 2
    assert (s.sampler_mesh, s.sampler_devices, s.sampler_reads) == (FSDP2, 0, "policy")
    assert (s.gvm_chunk, s.gvm_chunk_rows, s.gvm_rows, s.gvm_row_length, s.lora) == (0, 0, 0, 0, None)
    # 6 prompts in 2 mini-batches: 3 rows, bucketed to a power-of-two multiple of the micro-batch (2): 4
    six = step_shapes(load_config(None, TINY + ["sampling.prompts_per_step=6", "optim.mini_batches=2"]), FSDP2)
    assert (six.mini_batch_rows, six.mini_batch_rows_per_device) == (4, 2)  # 4 rows over fsdp=2
    assert s.mini_batch_rows_per_device == 1


def test_gvm_counts_its_per_prompt_budget():
    """GVM (stage 1: 4 samples per prompt, later steps 3): a packed row holds bucket(3) = 4 responses, 8 + 4 x 8 = 40
    tokens -> 64 on the grid; the sampler's worst call draws 4 per prompt (8 rows) with no rows sharing a prompt
    entry; the norm pass's chunk of 3 rows is rounded up to 4 (2 per device), stage 1's 8 rows are 2 chunks of
    unpacked rows of 8 + 8 = 16 -> 32 tokens."""
    cfg = load_config(None, TINY + ["sampling.allocation=gvm", "sampling.gvm_stage1_samples=4",
                                    "sampling.gvm_samples_per_prompt=3", "sampling.gvm_rows_per_chunk=3"])
    s = step_shapes(cfg, FSDP2)
    assert (s.samples_per_prompt, s.sampler_samples, s.varying_counts) == (3, 4, True)
    assert (s.responses_per_row, s.row_length) == (4, 64)
    assert (s.sampler_call.shapes.row_bucket, s.prompt_group) == (8, 1)
    assert (s.gvm_chunk, s.gvm_chunk_rows, s.gvm_chunk_rows_per_device) == (3, 4, 2)
    assert (s.gvm_rows, s.gvm_row_length) == (8, 32)


def test_rows_bounded_by_max_row_tokens_and_the_fill():
    """optim.max_row_tokens=20 with 4 samples of 8 tokens: (20 - 8) // 8 = 1 response per row, 16 tokens; at half
    fill (4-token responses) (20 - 8) // 4 = 3 fit, bucketed to 4, the row bounded by 20 tokens (grid: 32)."""
    cfg = load_config(None, TINY + ["sampling.samples_per_prompt=4", "optim.max_row_tokens=20"])
    assert (step_shapes(cfg, FSDP2).responses_per_row, step_shapes(cfg, FSDP2).row_length) == (1, 32)
    half = step_shapes(cfg, FSDP2, response_fill=0.5)
    assert (half.response_tokens, half.responses_per_row, half.row_length) == (4, 4, 32)


def test_where_the_sampler_runs_and_what_it_reads():
    """Sync: the trainer's policy; async or sampling.dtype: a copy of its own; async on 2 devices of its own: its
    versions there, on rollouts.sampler_mesh (or the mesh given)."""
    assert step_shapes(load_config(None, TINY + ["sampling.dtype=bfloat16"]), FSDP2).sampler_reads == "copy"
    assert step_shapes(load_config(None, TINY + ["rollouts.mode=async"]), FSDP2).sampler_reads == "copy"
    own = load_config(None, TINY + ["rollouts.mode=async", "rollouts.sampler_devices=2",
                                    "rollouts.sampler_mesh=fsdp=2"])
    s = step_shapes(own, {"data": 1, "fsdp": 1, "tensor": 2})
    assert (s.sampler_reads, s.sampler_devices, s.sampler_mesh, s.sampler_row_split) == ("own", 2, FSDP2, 2)
    given = step_shapes(own, {"data": 1, "fsdp": 1, "tensor": 2}, {"data": 2, "fsdp": 1, "tensor": 1})
    assert given.sampler_mesh == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 1}


def test_lora_spec_from_the_config():
    """lora.rank 4, alpha 8: scale 8 / 4 = 2; continuing an adapter at lora.rank 0 counts rank 1 from the config."""
    spec = step_shapes(load_config(None, TINY + ["lora.rank=4", "lora.alpha=8", "lora.targets=q,v"]), FSDP2).lora
    assert (spec.rank, spec.alpha, spec.scale, spec.targets) == (4, 8.0, 2.0, ("q_proj", "v_proj"))
    assert step_shapes(load_config(None, TINY + ["lora.adapter=/no/such/folder"]), FSDP2).lora.rank == 1


def test_meshes_and_bad_input():
    assert mesh_sizes(None) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert parse_mesh("data=2,fsdp=-1", 8) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}  # -1: the rest
    with pytest.raises(ValueError, match="mesh must give a size >= 1 for each of"):
        step_shapes(load_config(None, TINY), {"data": 1, "fsdp": 2})
    with pytest.raises(ValueError, match=r"response_fill must be in \(0, 1\], got 0"):
        step_shapes(load_config(None, TINY), FSDP2, response_fill=0)
