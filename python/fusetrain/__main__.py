"""`python -m fusetrain`: the fusetrain command line (train, evaluate, predict, inspect, info).

    python -m fusetrain train                     # the embedded default job
    python -m fusetrain train --model DIR --task seq-cls --train-file train.tsv --eval-file dev.tsv
    python -m fusetrain --help
"""

import sys

from fusetrain import _core


def main() -> int:
    """Runs the command line with this process's arguments; returns its exit status."""
    sys.stdout.flush()
    return _core._cli_main(["fusetrain", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
