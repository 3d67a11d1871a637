"""The `fusetrain` command (installed by pip) and `python -m fusetrain`: the engine's command line (train,
evaluate, predict, inspect, info) plus `report`.

    fusetrain train                               # the embedded default job
    fusetrain train --model DIR --task seq-cls --train-file train.tsv --eval-file dev.tsv --report-to tensorboard
    fusetrain report RUN_DIR                      # RUN_DIR/report.png and report.html from RUN_DIR/log.jsonl
    fusetrain --help
"""

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


def main() -> int:
    """Runs the command line with this process's arguments; returns its exit status."""
    argv = sys.argv[1:]
    if argv[:1] == ["report"]:
        return _report(argv[1:])
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
