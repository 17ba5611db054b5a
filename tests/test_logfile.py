"""sparkd's log file on a full disk (helper-45): every line it could not write printed logging's ~15-line
"--- Logging error ---" traceback to stderr (the journal), and nothing said which lines the file lacks. A real
``RotatingFileHandler`` subclass on a real full tmpfs (root only, as ``test_faults``' full state directory)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_faults import fill, small_tmpfs

from sparkd.logsetup import LogFileHandler


def test_a_log_file_on_a_full_disk_says_so_once_and_counts_the_lines_it_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with small_tmpfs(tmp_path / "logs", "1m") as fs:
        h = LogFileHandler(fs / "sparkd.log", maxBytes=10 * 2**20, backupCount=1)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log = logging.getLogger("sparkd.test_logfile")
        log.propagate, log.handlers = False, [h]
        try:
            log.warning("before the disk filled")
            filler = fill(fs)
            for i in range(50):
                log.warning("line %d while full, %s", i, "x" * 200)  # more than the buffer holds: writes fail
            err = capsys.readouterr().err
            assert "Logging error" not in err and "Traceback" not in err, err[:500]
            said = [ln for ln in err.splitlines() if ln.startswith("sparkd: cannot write")]
            assert len(said) == 1 and "No space left on device" in said[0], err[:500]
            assert h.lost > 0
            lost = h.lost
            filler.unlink()
            log.warning("after the room came back")
            h.flush()
            lines = (fs / "sparkd.log").read_text().splitlines()
            assert lines[0] == "WARNING sparkd.test_logfile: before the disk filled"
            assert lines[-1] == "WARNING sparkd.test_logfile: after the room came back"
            note = (
                f"WARNING sparkd.log: up to {lost} log lines were not written to this file, or only in part "
                "(OSError: [Errno 28]"
            )
            assert lines[-2].startswith(note), lines[-3:]
            assert h.lost == 0 and capsys.readouterr().err == ""
        finally:
            log.handlers = []
            h.close()


def test_a_log_call_whose_arguments_do_not_fit_its_format_keeps_its_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a write failure: logging's traceback names the faulty call, and no line of the file is counted lost
    (the full-disk handling swallowed it as "up to 1 log lines were not written … (TypeError …)")."""
    h = LogFileHandler(tmp_path / "sparkd.log", maxBytes=10 * 2**20, backupCount=1)
    log = logging.getLogger("sparkd.test_logfile.bug")
    log.propagate, log.handlers = False, [h]
    try:
        log.warning("%d samples", "not a number")
        err = capsys.readouterr().err
        assert "--- Logging error ---" in err and "TypeError" in err and "test_logfile.py" in err, err[:800]
        assert h.lost == 0
        log.warning("the next line")
        h.flush()
        assert (tmp_path / "sparkd.log").read_text().splitlines() == ["the next line"]
    finally:
        log.handlers = []
        h.close()
