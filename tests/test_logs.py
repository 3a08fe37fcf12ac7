"""Console output of a ``gem`` process: dependency notices dropped, the rest once (issue 18, item 4)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_silenced_notices_go_even_in_colour_and_others_stay():
    err = run_python(
        """
        import warnings
        from gem.logs import configure_logging
        configure_logging()
        warnings.warn("\\x1b[33mAdd type hints to the `predict` method to enable data validation\\x1b[0m", UserWarning)
        warnings.warn("Add type hints to the `predict` method, plain", UserWarning)
        warnings.warn("a warning about the user's own run", UserWarning)
        """
    )
    assert "type hints" not in err
    assert err.count("a warning about the user's own run") == 1


def test_a_repeated_log_message_is_printed_once():
    err = run_python(
        """
        import logging
        from gem.logs import configure_logging
        configure_logging()
        for _ in range(3):
            logging.getLogger("lightning.pytorch").warning("the same advice")
        logging.getLogger("gem").warning("another message")
        """
    )
    assert err.count("the same advice") == 1
    assert err.count("another message") == 1
