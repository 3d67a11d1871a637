"""A rank that dies or fails takes the whole `mpirun -np 2 fusetrain train` job down: it ends within 60 s with a
non-zero status, Open MPI's output names rank 1, and no checkpoint is left half written (none at all when none was
due; with saves every 2 steps, each checkpoint-* that exists is complete). Rank 1 fails alone through mpirun's
MPMD form (`A : B`), which gives it its own train file with a bad row."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from cli_support import CLI, data, tiny_model, train_args  # noqa: F401 (fixtures)

safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytest.importorskip("torch")
pytest.importorskip("transformers")

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed")
ENDS_WITHIN_S = 60


def rank_command(model, train_file, output, *extra):
    """One rank's `fusetrain train`: long enough that it is still training when the test acts."""
    return [str(CLI), *train_args(model, {"train": train_file}, output, "--per-device-train-batch-size", "4",
                                  "--max-steps", "100000", "--fusetrain-threads", "1", *extra)]


class Job:
    """mpirun in its own session, its output in files (a full pipe would stall the ranks); killed if left running."""

    def __init__(self, tmp_path, argv):
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        self.stdout, self.stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen([MPIRUN, "--oversubscribe", "-x", "OMP_NUM_THREADS", *argv], stdout=out,
                                            stderr=err, env=env, start_new_session=True)

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of mpirun's children, from OMPI_COMM_WORLD_RANK in each one's environment."""
        found = {}
        listed = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        for pid in map(int, listed.split()):
            try:
                with open(f"/proc/{pid}/environ", "rb") as environ:
                    variables = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
            except OSError:
                continue
            if b"OMPI_COMM_WORLD_RANK" in variables:
                found[int(variables[b"OMPI_COMM_WORLD_RANK"])] = pid
        return found

    def wait_until(self, ready, what: str):
        deadline = time.monotonic() + ENDS_WITHIN_S
        while not ready():
            assert self.process.poll() is None, f"the job ended before {what}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {ENDS_WITHIN_S} s:\n{self.output()[-3000:]}"
            time.sleep(0.05)

    def end(self) -> tuple[int, float]:
        """mpirun's exit status and the seconds it took to end from now."""
        start = time.monotonic()
        try:
            status = self.process.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs {ENDS_WITHIN_S} s later:\n{self.output()[-3000:]}")
        return status, time.monotonic() - start

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def jobs():
    """Starts Jobs; kills any still running when the test ends, passed or not."""
    started = []

    def start(tmp_path, argv) -> Job:
        started.append(Job(tmp_path, argv))
        return started[-1]
    yield start
    for job in started:
        job.kill()


def running(pid: int) -> bool:
    """Whether pid still runs: a zombie has ended (mpirun may exit before reaping a rank it killed; init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def logged_steps(output) -> int:
    log = output / "log.jsonl"
    return log.read_text().count('"loss"') if log.exists() else 0


def assert_no_checkpoint_half_written(output, model):
    names = set(safetensors_numpy.load_file(str(model / "model.safetensors")))
    for checkpoint in output.glob("checkpoint-*"):
        weights = checkpoint / "model.safetensors"
        assert weights.exists(), f"{checkpoint} has no model.safetensors"
        assert set(safetensors_numpy.load_file(str(weights))) == names, checkpoint  # loads: complete
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert checkpoint.name == f"checkpoint-{state['global_step']}"


@pytest.mark.parametrize("saving,steps_first", [
    (["--save-steps", "1000000"], 1),  # no save is due: no checkpoint may appear
    (["--save-steps", "2", "--save-total-limit", "2"], 10),  # saves in flight when rank 0 is stopped
], ids=["no-save-due", "saving-every-2-steps"])
def test_a_killed_rank_ends_the_job_and_leaves_no_half_written_checkpoint(jobs, tiny_model, data, tmp_path,
                                                                          saving, steps_first):
    output = tmp_path / "run"
    job = jobs(tmp_path, ["-np", "2", *rank_command(tiny_model, data["train"], output, *saving)])
    job.wait_until(lambda: len(job.ranks()) == 2 and logged_steps(output) >= steps_first,
                   f"{steps_first} logged training steps")
    ranks = job.ranks()
    os.kill(ranks[1], signal.SIGKILL)
    status, seconds = job.end()
    assert status != 0 and seconds < ENDS_WITHIN_S, job.output()[-3000:]
    assert re.search(rf"process rank 1 with PID \d+ on node \S+ exited on signal {signal.SIGKILL.value}",
                     job.output()), job.output()[-3000:]
    assert not any(running(pid) for pid in ranks.values()), "rank 0 outlived the job"
    assert_no_checkpoint_half_written(output, tiny_model)
    if steps_first == 1:
        assert not list(output.glob("checkpoint-*")) and not (output / "model.safetensors").exists()
    else:
        assert list(output.glob("checkpoint-*")), "no checkpoint was saved before the kill"


def test_a_rank_that_fails_ends_the_job(jobs, tiny_model, data, tmp_path):
    lines = data["train"].read_text().splitlines()
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join([*lines, "not-a-label\tthe row only rank 1 reads"]) + "\n")  # label<TAB>sentence
    output = tmp_path / "run"
    save = ["--save-steps", "1000000"]
    job = jobs(tmp_path, ["-np", "1", *rank_command(tiny_model, data["train"], output, *save), ":",
                          "-np", "1", *rank_command(tiny_model, bad, output, *save)])
    status, seconds = job.end()
    assert status != 0 and seconds < ENDS_WITHIN_S, job.output()[-3000:]
    text = job.output()
    errors = [line for line in text.splitlines() if line.startswith("fusetrain: error:")]
    assert errors == [f'fusetrain: error: {bad}:{len(lines) + 1}: label "not-a-label" is not an integer'], text
    assert re.search(r"Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+1\b", text), text  # rank 1, status 1
    assert not list(output.glob("checkpoint-*")) and not (output / "model.safetensors").exists()
