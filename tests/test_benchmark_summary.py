"""benchmarks/README.md's table and README's "How fast" lines are what benchmarks/summary.py writes from
benchmarks/results today, every row traces to results files that exist and to a command, and every notebook section
opens with its one-line conclusion."""

import difflib
import importlib.util
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "benchmarks" / "README.md"


def _load_summary():
    spec = importlib.util.spec_from_file_location("benchmark_summary", ROOT / "benchmarks" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


summary = _load_summary()


def _between(path: pathlib.Path, start: str, end: str) -> str:
    text = path.read_text(encoding="utf-8")
    assert text.count(start) == 1 and text.count(end) == 1, f"{path.name} needs one {start} ... {end} pair"
    return text.split(start)[1].split(end)[0].strip()


@pytest.mark.parametrize("path, start, end, render", [
    (NOTEBOOK, summary.START, summary.END, summary.table),
    (ROOT / "README.md", summary.README_START, summary.README_END, summary.how_fast),
], ids=["benchmarks/README.md", "README.md"])
def test_doc_is_the_scripts_output(path, start, end, render):
    current, expected = _between(path, start, end), render()
    if current != expected:
        diff = "".join(list(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                                 path.name, "generated"))[:40])
        pytest.fail(f"{path.relative_to(ROOT)} is stale: run python benchmarks/summary.py --write\n{diff}")


def test_table_opens_the_notebook():
    text = NOTEBOOK.read_text(encoding="utf-8")
    first_section = re.search(r"^## Sampler", text, re.M).start()
    assert text.index(summary.END) < first_section
    assert "\n## " not in text[:text.index(summary.START)].split("## At a glance")[1]


def test_every_row_names_results_files_that_exist_and_a_command():
    rows = summary.rows()
    assert len(rows) >= 15
    table = summary.table()
    for row in rows:
        assert row.files, row.figure
        for name in row.files:
            assert (summary.RESULTS / name).is_file(), f"{row.figure}: benchmarks/results/{name} is missing"
            assert f"[{name}](results/{name})" in table
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", row.date) and row.machine and row.commit, row.figure
        for command in row.command.split("\n"):
            scripts = re.findall(r"(?:benchmarks/\w+\.(?:py|sh)|configs/[\w/.-]+\.yaml)", command)
            assert scripts or "jaxrl-llm train" in command, f"{row.figure}: {command!r} names no script"
            for script in scripts:
                assert (ROOT / script).is_file(), f"{row.figure}: {script} does not exist"
            assert f"`{command}`" in table
        assert (row.ratio or row.of_limit) and all(v > 0 for v in row.ratio + row.of_limit), row.figure


def test_results_recorded_from_the_notebook_say_so():
    recorded = 0
    headings = {line.lstrip("#").strip() for line in NOTEBOOK.read_text(encoding="utf-8").splitlines()
                if line.startswith("#")}
    for path in sorted(summary.RESULTS.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if "source" not in data:
            continue
        recorded += 1
        section = re.fullmatch(r'recorded from benchmarks/README\.md section "(.+?)".*', data["source"])
        assert section and section.group(1) in headings, f"{path.name}: {data['source']}"
        assert all(data.get(key) for key in ("date", "machine", "command")), path.name
    assert recorded == 5


def test_ratios_and_their_text_pin_hand_computed_values():
    by = {row.short: row for row in summary.rows()}
    demo = by["CPU GRPO step, demo shape, vs trl"]
    assert demo.ratio[0] == pytest.approx(116.4314 / 23.4014, rel=1e-4)  # TRL's median step / ours
    assert summary.ratio_text(demo) == "**4.98x** faster"
    gpu = by["GPU train step vs torch"]
    assert gpu.ratio[0] == pytest.approx(2.3458 / 33.7149, rel=1e-4)
    assert summary.ratio_text(gpu) == "0.07x: **14.4x slower**"
    rollouts = by["CPU rollouts vs tunix"]  # two runs: 226.51 / 75.52 and 248.22 / 72.18 useful tok/s
    assert summary.ratio_text(rollouts) == "**3.00-3.44x** faster"
    assert by["GVM (paper's) samples vs uniform"].ratio[0] == pytest.approx(5599.78 / 10970.62, rel=1e-5)


def test_every_notebook_section_opens_with_its_conclusion():
    lines = NOTEBOOK.read_text(encoding="utf-8").splitlines()
    missing = []
    for i, line in enumerate(lines):
        if re.match(r"#{2,3} ", line):
            first = next(text for text in lines[i + 1:] if text.strip())
            if not first.startswith("**In one line:** "):
                missing.append(line)
    assert not missing, f"sections without a first-line conclusion: {missing}"


def test_figure_is_committed_and_small():
    data = summary.FIGURE.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 120_000
    assert "](summary.png)" in summary.table()
