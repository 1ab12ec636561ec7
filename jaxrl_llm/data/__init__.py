"""Problem sources, prompts and the grain pipeline.

records (question / gold answer dicts) -> ``build_prompts`` (token ids, long prompts dropped)
-> ``RecordBatches`` (shard, seeded shuffle, batches, epochs; checkpointable position).
"""

from jaxrl_llm.data.arithmetic import ArithmeticTask, evaluate_expression
from jaxrl_llm.data.benchmarks import (BENCHMARK_FIELDS, BENCHMARKS, champ_from_json, gsm8k100_from_templates,
                                       load_benchmark, register_benchmark)
from jaxrl_llm.data.load import KINDS as SOURCE_KINDS, load_records
from jaxrl_llm.data.pipeline import LoaderConfig, RecordBatches, make_dataset, shard_records
from jaxrl_llm.data.prompts import (ARITHMETIC_EXEMPLARS, DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_SUFFIX,
                                    PROMPT_PRESETS, PromptStats, PromptTemplate, build_prompts, prompt_template)
from jaxrl_llm.data.reasoning_gym_tasks import REASONING_GYM_TASKS, reasoning_gym_records, reasoning_gym_split
from jaxrl_llm.data.records import (BadDataError, BadRows, FieldSpec, fields, gold_answer, gsm8k_final_answer,
                                    last_boxed_content, make_record, records_from_rows)
from jaxrl_llm.data.sources import load_file, load_hf_disk, load_json, load_jsonl, load_parquet, load_tfds

__all__ = [
    "ARITHMETIC_EXEMPLARS", "ArithmeticTask", "BENCHMARKS", "BENCHMARK_FIELDS", "BadDataError", "BadRows",
    "DEFAULT_SYSTEM_PROMPT", "DEFAULT_USER_SUFFIX", "FieldSpec", "LoaderConfig", "PROMPT_PRESETS", "PromptStats",
    "PromptTemplate", "REASONING_GYM_TASKS", "RecordBatches", "build_prompts", "champ_from_json",
    "evaluate_expression", "fields", "gold_answer", "gsm8k100_from_templates", "gsm8k_final_answer",
    "SOURCE_KINDS", "last_boxed_content", "load_benchmark", "load_records", "load_file", "load_hf_disk", "load_json", "load_jsonl",
    "load_parquet", "load_tfds", "make_dataset", "make_record", "prompt_template", "reasoning_gym_records",
    "reasoning_gym_split", "records_from_rows", "register_benchmark", "shard_records",
]
