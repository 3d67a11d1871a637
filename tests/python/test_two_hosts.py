"""Data parallel across two hosts: two Linux network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2)
stand in for two machines. mpirun runs in the first; Open MPI starts the second host's daemon through an rsh agent
that runs it with `ip netns exec` instead of ssh, and the ranks talk TCP over the veth only (btl tcp,self). Two
ranks x batch 4 train as one process with batch 8 (per-step losses within 1e-5 relative, weights within 1e-5), and
the veth carried at least every step's gradients in each direction while the namespaces' loopbacks did not.

Skipped where namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from cli_support import CLI, ROOT  # noqa: E402
from test_data_parallel import tiny  # noqa: E402,F401  (the fixture: a 2-layer BERT without dropout)

MPIRUN = shutil.which("mpirun")
IP = shutil.which("ip")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
STEPS = 10
pytestmark = [pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed"),
              pytest.mark.skipif(IP is None, reason="iproute2's `ip` is not installed")]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)


def counter(namespace: str, device: str, name: str) -> int:
    result = ip("netns", "exec", namespace, "cat", f"/sys/class/net/{device}/statistics/{name}")
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.fixture
def hosts():
    """Two namespaces with lo up and a veth pair between them; yields [(namespace, veth), ...], one per address.
    Teardown kills what still runs inside and deletes both (which deletes the veth), whatever the test did."""
    tag = uuid.uuid4().hex[:6]
    pairs = [(f"fusetrain-host-{side}-{tag}", f"ftv{tag}{side}") for side in "ab"]
    made = []
    try:
        for namespace, _ in pairs:
            result = ip("netns", "add", namespace)
            if result.returncode != 0:
                pytest.skip(f"cannot create a network namespace: ip netns add: {result.stderr.strip()}")
            made.append(namespace)
        steps = [("link", "add", pairs[0][1], "type", "veth", "peer", "name", pairs[1][1])]
        for (namespace, veth), address in zip(pairs, ADDRESSES):
            steps += [("link", "set", veth, "netns", namespace),
                      ("-n", namespace, "addr", "add", f"{address}/24", "dev", veth),
                      ("-n", namespace, "link", "set", "lo", "up"),
                      ("-n", namespace, "link", "set", veth, "up")]
        for step in steps:
            result = ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot join two network namespaces: ip {' '.join(step)}: {result.stderr.strip()}")
        yield pairs
    finally:
        for namespace in made:
            for pid in ip("netns", "pids", namespace).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "del", namespace)


def train_command(tiny, train_file, output, batch):
    return [str(CLI), "train", "--model", str(tiny), "--train-file", str(train_file), "--logging-steps", "1",
            "--save-strategy", "no", "--learning-rate", "1e-3", "--max-seq-length", "32", "--disable-tqdm",
            "--fusetrain-threads", "1", "--max-steps", str(STEPS), "--per-device-train-batch-size", str(batch),
            "--output-dir", str(output)]


def results(output):
    losses = [json.loads(line)["loss"] for line in (output / "log.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return losses, safetensors_numpy.load_file(str(output / "model.safetensors"))


def test_two_hosts_over_tcp_train_as_one_process_with_the_global_batch(hosts, tiny, tmp_path):
    (first, first_veth), (second, second_veth) = hosts
    data = tmp_path / "train.tsv"
    data.write_text("\n".join((ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[:161]) + "\n")
    agent = tmp_path / "netns-agent"  # called as ssh would be: AGENT HOST COMMAND... (one shell command line)
    agent.write_text("#!/bin/sh\nhost=$1; shift\ncase \"$host\" in\n"
                     f"  {ADDRESSES[0]}) namespace={first} ;;\n  {ADDRESSES[1]}) namespace={second} ;;\n"
                     "  *) echo \"netns-agent: expected a hostfile address, found $host\" >&2; exit 255 ;;\n"
                     f"esac\nexec {IP} netns exec \"$namespace\" /bin/sh -c \"$*\"\n")
    agent.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{address} slots=1\n" for address in ADDRESSES))

    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    exports = [item for name in ("PATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS") if name in env
               for item in ("-x", name)]
    mpirun = [IP, "netns", "exec", first, MPIRUN, "-np", "2", "--hostfile", str(hostfile),
              "--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "tcp,self",
              "--mca", "btl_tcp_if_include", "10.77.0.0/24", "--mca", "oob_tcp_if_include", "10.77.0.0/24",
              *exports, "sh", "-c", f'{IP} -o -4 addr show >&2 && exec "$@"', "rank-address"]
    before = {(ns, dev, name): counter(ns, dev, name) for ns, dev in [(first, first_veth), (first, "lo"),
              (second, "lo")] for name in ("tx_bytes", "rx_bytes")}
    many = subprocess.run([*mpirun, *train_command(tiny, data, tmp_path / "many", 4)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert many.returncode == 0, many.stderr[-3000:]
    grown = {key: counter(*key) - value for key, value in before.items()}
    # each rank printed its interfaces before training: one on each host's address
    assert f"inet {ADDRESSES[0]}/24" in many.stderr and f"inet {ADDRESSES[1]}/24" in many.stderr, many.stderr

    one = subprocess.run(train_command(tiny, data, tmp_path / "one", 8), capture_output=True, text=True, env=env,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    one_losses, one_weights = results(tmp_path / "one")
    many_losses, many_weights = results(tmp_path / "many")
    assert len(many_losses) == len(one_losses) == STEPS
    np.testing.assert_allclose(many_losses, one_losses, rtol=1e-5)
    for name, value in one_weights.items():
        np.testing.assert_allclose(many_weights[name], value, atol=1e-5, err_msg=name)

    # An all-reduce of G bytes between two ranks sends and receives at least G on each side; fp32 gradients.
    gradient_bytes = STEPS * sum(value.size * 4 for value in one_weights.values())
    assert grown[(first, first_veth, "tx_bytes")] >= gradient_bytes, grown
    assert grown[(first, first_veth, "rx_bytes")] >= gradient_bytes, grown
    for namespace in (first, second):
        assert grown[(namespace, "lo", "tx_bytes")] < gradient_bytes // STEPS, grown  # not one step's worth
