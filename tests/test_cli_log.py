"""autopar's log level is the caller's: a parity run in this process leaves it as it was."""

from __future__ import annotations

import logging

from autopar.cli.log import quiet
from autopar.cli.parity import run_plans

from jobs import tiny_job


def test_quiet_drops_info_inside_and_restores_the_level_it_found():
    logger = logging.getLogger("autopar")
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        with quiet():
            assert not logger.isEnabledFor(logging.INFO)
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)


def test_an_in_process_parity_run_leaves_a_later_trainings_info_lines_shown(tmp_path):
    logger = logging.getLogger("autopar")
    before = logger.level
    (run,) = run_plans([("single device", tiny_job(tmp_path, "--training.steps", "1"))], 1)
    assert len(run.losses) == 1
    assert logger.level == before
