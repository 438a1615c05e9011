"""Benchmarks create the directories their options name, or refuse naming the path (issue 32, item 10)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from output_paths import output_dir, output_file  # noqa: E402


def test_output_dir_creates_missing_parents(tmp_path) -> None:
    target = tmp_path / "a" / "b" / "swap"
    assert output_dir(str(target)) == str(target)
    assert target.is_dir()
    assert output_dir(str(target)) == str(target)  # existing: accepted as is


def test_output_file_creates_its_directory_only(tmp_path) -> None:
    target = tmp_path / "results" / "day" / "run.json"
    assert output_file(str(target)) == str(target)
    assert target.parent.is_dir() and not target.exists()


def test_uncreatable_directory_is_an_argparse_error_naming_it(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match=r"cannot create directory '.*file/swap': Not a directory; give a writable path"):
        output_dir(str(blocker / "swap"))


def test_largest_tiered_creates_nvme_path_before_any_work(tmp_path) -> None:
    """The failure the issue reports: a missing --nvme-path directory. Parsing now creates it; a
    path that cannot exist stops the script at once with the option named (exit status 2)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "largest_tiered.py"), "--nvme-path", str(blocker / "swap"),
                           "--out", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "argument --nvme-path: cannot create directory" in proc.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_directory_is_refused(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(argparse.ArgumentTypeError, match="is not writable"):
        output_dir(str(locked))
