"""`fusetrain launch -n N [--hosts ...] -- <subcommand>` runs mpirun on `python -m fusetrain <subcommand>`: bad
input gets one error naming what was expected and what was found (exit status 2), mpirun's arguments and
environment are the documented ones (a stand-in mpirun records them), its exit status is the command's, and two
real ranks train the tiny model as one run that rank 0 alone logs."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from cli_support import data, tiny_model, train_args  # noqa: F401 (fixtures)

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT_VARIABLES = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def launch(*args, env=None, cwd=None):
    """`python -m fusetrain launch ARGS`; a variable that `env` maps to None is removed."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    environment.update(env or {})
    environment = {name: value for name, value in environment.items() if value is not None}
    return subprocess.run([sys.executable, "-m", "fusetrain", "launch", *args], capture_output=True, text=True,
                          env=environment, cwd=cwd, timeout=600)


def launch_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("fusetrain: error: launch:")]
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("args,expected", [
    ([], "expected `--` before the fusetrain subcommand, found no arguments"),
    (["-n", "2", "train"], "expected `--` before the fusetrain subcommand, found `-n 2 train` without it"),
    (["-n", "2", "--"], "expected a fusetrain subcommand after `--`"),
    (["-n", "0", "--", "train"], "expected an integer >= 1, found '0'"),
    (["-n", "-3", "--", "train"], "expected an integer >= 1, found '-3'"),
    (["-n", "two", "--", "train"], "expected an integer >= 1, found 'two'"),
    (["--", "train"], "expected -n N (the number of processes), found no -n"),
    (["-n", "2", "--hosts", "--", "train"], "expected a value after --hosts, found none"),
    (["-n", "2", "--hosts", "a,,b", "--", "train"], "comma-separated list of host names, found 'a,,b'"),
    (["-n", "2", "--np", "2", "--", "train"], "expected -n or --hosts before `--`, found '--np'"),
])
def test_usage_errors_name_what_was_expected_and_found(args, expected):
    assert expected in launch_error(launch(*args))


def test_without_mpirun_on_path_the_error_says_so(tmp_path):
    line = launch_error(launch("-n", "2", "--", "info", env={"PATH": str(tmp_path)}))
    assert f"expected Open MPI's mpirun on PATH, found none (PATH={tmp_path})" in line


@pytest.fixture
def fake_mpirun(tmp_path):
    """An `mpirun` first on PATH that records its arguments and environment and exits with status 7."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "mpirun.json"
    script = bin_dir / "mpirun"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                      f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
                      "sys.exit(7)\n")
    script.chmod(0o755)

    def run(*args, env=None):
        result = launch(*args, env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **(env or {})})
        assert result.returncode == 7, result.stderr  # mpirun's status is the command's
        return json.loads(record.read_text())
    return run


def test_runs_mpirun_on_this_python_and_exports_the_environment(fake_mpirun):
    seen = fake_mpirun("-n", "1", "--", "train", "--max-steps", "3", env={"OMP_NUM_THREADS": "5"})
    argv = seen["argv"]
    assert argv[:2] == ["-np", "1"] and "--oversubscribe" not in argv and "--host" not in argv
    assert argv[-6:] == [sys.executable, "-m", "fusetrain", "train", "--max-steps", "3"]
    exported = [argv[i + 1] for i, flag in enumerate(argv) if flag == "-x"]
    assert {"PATH", "PYTHONPATH", "OMP_NUM_THREADS"} <= set(exported)
    assert seen["env"]["OMP_NUM_THREADS"] == "5"  # the user's value is kept


def test_more_ranks_than_cores_oversubscribe_and_share_the_cores(fake_mpirun):
    logical = len(os.sched_getaffinity(0))  # at least the physical cores Open MPI counts
    seen = fake_mpirun("-n", str(logical + 1), "--", "train", env={"OMP_NUM_THREADS": None})
    assert "--oversubscribe" in seen["argv"]
    assert seen["env"]["OMP_NUM_THREADS"] == "1"


def test_hosts_go_to_mpirun_without_oversubscribing(fake_mpirun):
    seen = fake_mpirun("-n", "64", "--hosts", "node1:32,node2:32", "--", "train")
    argv = seen["argv"]
    assert argv[argv.index("--host") + 1] == "node1:32,node2:32" and "--oversubscribe" not in argv
    assert "PYTHONPATH" in [argv[i + 1] for i, flag in enumerate(argv) if flag == "-x"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root-only variables are set only when running as root")
def test_as_root_sets_the_allow_variables_only_when_unset(fake_mpirun):
    unset = fake_mpirun("-n", "1", "--", "info", env=dict.fromkeys(ROOT_VARIABLES))["env"]
    assert all(unset[name] == "1" for name in ROOT_VARIABLES)
    kept = fake_mpirun("-n", "1", "--", "info", env={name: "mine" for name in ROOT_VARIABLES})["env"]
    assert all(kept[name] == "mine" for name in ROOT_VARIABLES)


@pytest.mark.skipif(os.geteuid() == 0, reason="checks a user who is not root")
def test_not_as_root_leaves_the_allow_variables_unset(fake_mpirun):
    assert not set(ROOT_VARIABLES) & set(fake_mpirun("-n", "1", "--", "info", env=dict.fromkeys(ROOT_VARIABLES))["env"])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_two_ranks_train_as_one_run_that_rank_0_logs(tiny_model, data, tmp_path):  # noqa: F811 (fixtures)
    output = tmp_path / "run"
    args = train_args(tiny_model, data, output, "--max-steps", "3", "--per-device-train-batch-size", "4",
                      "--save-strategy", "no", "--fusetrain-threads", "1")
    result = launch("-n", "2", "--", *args, env={"OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3]  # once each: rank 1 wrote nothing
    assert len(logged) == 4 and "train_loss" in logged[-1]
    # 160 examples, 2 ranks x 4: each step is a global batch of 8, 1/20 of an epoch (one process: 1/40)
    assert [entry["epoch"] for entry in steps] == pytest.approx([0.05, 0.1, 0.15])
    assert (output / "model.safetensors").exists()
