"""The transformers versions the Python layer supports: the declared minimum, the check that enforces it, and what
an installed transformers gets (scripts/version_matrix.sh runs this file in each cell, an older transformers too)."""

import pathlib
import re
import subprocess
import sys
from importlib import metadata

import pytest

from cli_support import env_finding_fusetrain
from fusetrain._versions import TRANSFORMERS_MIN, check_transformers, counts_unshifted_labels, release

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEEDED = ".".join(map(str, TRANSFORMERS_MIN))


def test_pyproject_declares_the_minimum_the_check_enforces():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = set(re.findall(r'"transformers>=([0-9.]+)"', pyproject))
    assert declared == {NEEDED}, declared  # every extra that pulls transformers declares the same minimum
    assert '"transformers"' not in pyproject  # none leaves it open


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.2.0", "4.9.0"])
def test_an_older_transformers_is_refused_with_one_clear_error(version):
    with pytest.raises(ImportError) as refused:
        check_transformers(version)
    message = str(refused.value)
    assert f"found transformers {version}" in message and f"transformers >= {NEEDED}" in message, message
    assert f"pip install -U 'transformers>={NEEDED}'" in message, message


@pytest.mark.parametrize("version", ["5.3.0", "5.25.0", "6.0.0.dev0", "10.1"])
def test_a_supported_transformers_passes(version):
    check_transformers(version)


def test_release_reads_the_numeric_part():
    assert release("5.25.0") == (5, 25, 0)
    assert release("6.0.0.dev0") == (6, 0, 0)
    assert release("4.57.6+local") == (4, 57, 6)
    assert release("garbage") == ()


def test_the_installed_transformers_trains_or_is_refused_at_import():
    """With a supported transformers `fusetrain.Trainer` imports and subclasses transformers'; with an older one the
    import is the refusal above and nothing else (the matrix's transformers 4.57 cell)."""
    installed = metadata.version("transformers")
    code = ("import fusetrain, transformers; "
            "assert issubclass(fusetrain.Trainer, transformers.Trainer); "
            "from fusetrain.trl import SFTTrainer; print('imported')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env_finding_fusetrain())
    if release(installed) >= TRANSFORMERS_MIN:
        assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-2000:]
    else:
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: fusetrain.Trainer needs transformers >= ") and installed in last, last


def test_causal_lm_item_counts_follow_the_transformers_that_computes_them():
    """transformers 5.3-5.10 count a causal LM's num_items_in_batch over every label (their Trainer has no
    `_loss_shifts_labels`); 5.11 and later over the shifted labels when that attribute is true. The matrix's 5.3
    cell checks the logged losses against TRL's under 5.3 (test_trl.py's padded case)."""
    class Before511:
        pass

    class ShiftingLoss:
        _loss_shifts_labels = True

    class LossNotYetKnownToShift:  # GPT-2 before its first forward, in 5.11 and later
        _loss_shifts_labels = False

    assert counts_unshifted_labels(Before511())
    assert not counts_unshifted_labels(ShiftingLoss())
    assert counts_unshifted_labels(LossNotYetKnownToShift())
