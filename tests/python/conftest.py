"""Makes `import fusetrain` find the package.

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
