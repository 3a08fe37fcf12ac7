"""Console output of the ``gem`` command: one line per message, each log message once.

:func:`configure_logging` gives the process one log handler (libraries that configure their own, such as
Lightning's, otherwise print every line twice once anything configures the root logger), prints a repeated
log message once (Python prints a warning once per place already), keeps MLflow's bookkeeping lines out (the CLI prints run ids and paths itself),
and drops the third-party notices a user can do nothing about (:data:`SILENCED`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

# Notices from dependencies that say nothing about the user's run: a deprecation inside Lightning's own
# code, an advertisement, restatements of settings the run chose, a torch.fx note torchrec triggers, and
# MLflow's advice on pyfunc type hints (the value model validates its requests itself).
SILENCED = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r".*litlogger",
    r"`Trainer\(val_check_interval=1.0\)` was configured so validation will run",
    r"is_fx_tracing will return true",
    r"The '(train|val)_dataloader' does not have many workers",
    r"You are using a CUDA device .* that has Tensor Cores",
    r".*Add type hints to the `predict` method",  # MLflow wraps it in terminal colour codes
)
LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")
QUIET_LOGGERS = {"mlflow": logging.WARNING, "alembic": logging.WARNING, "torch.fx._symbolic_trace": logging.ERROR}


class OncePerProcess(logging.Filter):
    """Pass each distinct message once, and none matching :data:`SILENCED`."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(re.search(pattern, message) for pattern in SILENCED) or message in self.seen:
            return False
        self.seen.add(message)
        return True


def route_library_loggers() -> None:
    """Send Lightning's log records to the process's handler only. Lightning adds a console handler to its
    logger when imported, so call this again after importing it; without :func:`configure_logging` (a
    library user's process) it leaves logging alone."""
    root_handlers = logging.getLogger().handlers
    if not any(any(isinstance(f, OncePerProcess) for f in h.filters) for h in root_handlers):
        return
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for own in list(logger.handlers):
            logger.removeHandler(own)
        logger.propagate = True


def configure_logging() -> None:
    """Set up the process's console output as the module doc says; call once, early, from an entry point.

    The root logger stays at WARNING (libraries' INFO chatter, e.g. fbgemm's, stays out); Lightning's loggers
    keep the INFO level they set themselves and now reach the one handler.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(OncePerProcess())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    route_library_loggers()
    # MLflow sets its loggers' level from this variable when it is imported (later, lazily); a user's value wins.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(quiet)
    for pattern in SILENCED:
        warnings.filterwarnings("ignore", message=pattern)
