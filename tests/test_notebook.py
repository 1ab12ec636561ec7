"""examples/colab_gvm_raft.ipynb runs end to end on CPU with a tiny setting injected after its parameter cell."""

import json
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "colab_gvm_raft.ipynb"
KERNEL = "jaxrl-llm-test"

# The smallest setting that still exercises both GVM stages, the update, evaluation and the plots: one prompt of 2
# samples a step (the notebook's run is execution-bound: a step's time is its rows'). 16 new tokens fit the 3-shot
# prompt's answer ("2 - 7 = -5 \\boxed{-5}"), so stage 1 accepts samples and stage 2 runs. Evaluation has the shape
# of a training step (1 problem x 2 samples), so the sampler compiles once for both.
PROMPTS, SAMPLES = 1, 2
TINY = f"""\
STEPS = 1
PROMPTS_PER_STEP = {PROMPTS}
SAMPLES_PER_PROMPT = {SAMPLES}
MAX_NEW_TOKENS = 16
EVAL_PROBLEMS = {PROMPTS}
EVAL_SAMPLES = 2
OUT_DIR = {{out_dir!r}}
"""


def register_kernel(root: pathlib.Path) -> None:
    """A kernelspec for this interpreter (the project's .venv) under root/kernels, found through JUPYTER_PATH,
    so the test needs no kernel installed on the machine."""
    folder = root / "kernels" / KERNEL
    folder.mkdir(parents=True)
    # The notebook runs as a user runs it, with full XLA optimization: it is execution-bound, unlike the rest
    # of the suite, which conftest.py compiles with backend optimizations off.
    env = {"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "jaxrl_llm test (.venv)", "language": "python", "env": env}
    (folder / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")


def parameter_cell_index(nb) -> int:
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{NOTEBOOK.name} needs exactly one cell tagged 'parameters', found {len(tagged)}"
    return tagged[0]


def test_notebook_structure():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    sources = [cell.source for cell in nb.cells]
    first_code = next(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert "REPO_URL" in first_code and 'jaxrl_llm @ git+' in first_code
    assert 'find_spec("jaxrl_llm") is None' in first_code  # the install is skipped when already installed
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit it without outputs"
    params = nb.cells[parameter_cell_index(nb)].source
    for name in ("STEPS", "PROMPTS_PER_STEP", "SAMPLES_PER_PROMPT", "MAX_NEW_TOKENS", "EVAL_PROBLEMS", "OUT_DIR"):
        assert f"{name} = " in params, name
    joined = "\n".join(sources)
    assert "gvm_raftpp.yaml" in joined and "raftpp.yaml" in joined and "jax.default_backend()" in joined


@pytest.mark.slow
def test_notebook_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    register_kernel(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    injected = nbformat.v4.new_code_cell(TINY.format(out_dir=str(tmp_path / "runs")))
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(parameter_cell_index(nb) + 1, injected)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(ROOT)}})
    try:
        client.execute()  # raises CellExecutionError, naming the cell, when any cell fails
        check_outputs(nb, tmp_path / "runs")
    finally:
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)  # two runs' exports, ~1 GB


def check_outputs(nb, runs: pathlib.Path) -> None:
    """What the executed notebook printed, plotted and logged."""
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    assert "backend cpu" in text
    assert "GVM-RAFT++ 1 steps, RAFT++ 2 steps" in text
    # The summary table: RAFT++ draws 2 steps x prompts x samples; GVM prompts x samples in stage 1 plus a stage-2
    # budget of as many (not drawn when no stage-1 sample was accepted).
    drawn = PROMPTS * SAMPLES
    gvm_line = next(line for line in text.splitlines() if line.startswith("GVM-RAFT++ "))
    raftpp_line = next(line for line in text.splitlines() if line.startswith("RAFT++ "))
    assert gvm_line.split()[1] == "1" and gvm_line.split()[2] in (str(drawn), str(2 * drawn)), gvm_line
    assert raftpp_line.split()[1:3] == ["2", str(2 * drawn)], raftpp_line
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 2, "the allocation plot and the learning curves"
    assert (runs / "gvm_raftpp" / "metrics.jsonl").is_file()
    assert (runs / "gvm_raftpp" / "final").is_dir() and not (runs / "gvm_raftpp" / "checkpoints").exists()
    rows = [json.loads(line) for line in (runs / "gvm_raftpp" / "metrics.jsonl").read_text().splitlines()]
    allocation = [row for row in rows if "gvm_n" in row]
    assert allocation and all(len(row["gvm_n"]) == PROMPTS for row in allocation)
    assert "log-prob of the rewarded response" in text
