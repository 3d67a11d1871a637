"""Makes `import fusetrain` find the package, and keeps tests marked `slow` for runs that ask for them
(FUSETRAIN_RUN_SLOW=1): the README's test command, which CI runs, leaves them out.

Order: $FUSETRAIN_PYTHON_PATH (set by the CMake test, pointing at build/python),
then an installed fusetrain (`pip install .`), then the development build in
<repo>/build/python written by `bash scripts/build.sh`.
"""

import importlib.util
import os
import pathlib
import sys

_explicit = os.environ.get("FUSETRAIN_PYTHON_PATH")
if _explicit:
    sys.path.insert(0, _explicit)
elif importlib.util.find_spec("fusetrain") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "build" / "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs (the full crash test, a script's two-seed comparison on both "
                            "trainers); FUSETRAIN_RUN_SLOW=1 runs them")


def pytest_collection_modifyitems(config, items):
    import pytest

    if os.environ.get("FUSETRAIN_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set FUSETRAIN_RUN_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
