"""shardwise's log lines go through stdlib logging ("shardwise"), rank 0 only unless [log] all_ranks,
and can be routed or silenced like any library's."""

import logging
import sys

import pytest

from shardwise import logs
from shardwise.testing import run_command


@pytest.fixture
def clean_logger():
    logger = logging.getLogger(logs.LOGGER_NAME)
    saved = (logger.level, list(logger.filters), list(logger.handlers), logger.propagate)
    logger.filters.clear()
    logger.handlers.clear()
    yield logger
    logger.setLevel(saved[0])
    logger.filters[:] = saved[1]
    logger.handlers[:] = saved[2]
    logger.propagate = saved[3]


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.rank, record.getMessage()))


def test_rank_filter_routing_and_silencing(clean_logger, capsys):
    from shardwise.runtime.session import Session

    mine = Records()
    clean_logger.addHandler(mine)  # the application routes the logger itself
    logs.configure(1)
    with Session(strategy="single") as session:
        session.log("from rank 1")  # rank 1 of a (pretend) job: filtered
    logs.configure(1, all_ranks=True)
    logging.getLogger("shardwise").info("every rank speaks")
    logs.configure(0, level="warning")
    logging.getLogger("shardwise").info("silenced")
    logging.getLogger("shardwise").warning("still shown")
    assert mine.lines == [("INFO", 1, "every rank speaks"), ("WARNING", 0, "still shown")]
    assert capsys.readouterr().err == ""  # an application handler means no shardwise stderr handler


def test_default_handler_writes_timestamped_lines_to_the_current_stderr(clean_logger, capsys):
    # pytest attaches its log-capture handlers to a logger that does not propagate (as ours does
    # after an earlier test configured it) when the test's call starts, after the fixture ran:
    # a logger without handlers is the case under test.
    clean_logger.handlers.clear()
    logs.configure(0)
    logging.getLogger("shardwise").info("hello")
    logs.configure(3, all_ranks=True)
    logging.getLogger("shardwise.sub").info("child logger")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[") and err[0].endswith("] hello")
    assert err[1].endswith("] [rank 3] child logger")
    assert [h.get_name() for h in clean_logger.handlers] == ["shardwise-stderr"]  # added once
    assert not clean_logger.propagate  # a root handler (basicConfig) does not print each line twice


def test_log_level_from_the_recipe_silences_the_trainer(tmp_path, cli_env):
    common = [sys.executable, "-m", "shardwise", "train", "--strategy", "single", "--nproc", "1",
              "--set", "model.preset=nano", "--set", "train.steps=1", "--set", "train.sample_tokens=0",
              "--set", "train.eval_batches=1", "--set", "train.progress=false"]
    quiet = run_command([*common, "--set", "log.level=warning", "--out", str(tmp_path / "q")],
                        env=cli_env, timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "strategy=single" not in quiet.stderr and "final train loss" in quiet.stdout
    bad = run_command([*common, "--set", "log.level=loud", "--dry-run"], env=cli_env, timeout=120)
    assert bad.returncode == 2 and "log.level" in bad.stderr and "warning" in bad.stderr
