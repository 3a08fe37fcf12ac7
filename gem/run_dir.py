"""A training run's directory: one run per directory, one writer at a time, its config on record.

``gem train`` keeps everything of a run under ``<train.out_dir>/<name>/``::

    config.json             the resolved config the run started with
    mlflow_run_id           its MLflow run (written as soon as the run exists)
    checkpoints/last.ckpt   the newest checkpoint (``last.dcp/`` under ``parallel.enabled``)
    .lock                   held while a process trains the run

A second command naming the same directory either continues that run (same config up to the fields a
resume may change, :data:`RESUMABLE_PREFIXES`) or is refused with the reason, before anything is
written: separate runs never overwrite each other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from foundation.checkpoint import RUN_ID_FILE
from foundation.config import ConfigError
from foundation.data.io import atomic_write_text

RUN_CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"
# Config keys a resumed run may change: how long and how it trains, not what it trains. A changed value is
# recorded in the run (``gem.resume.changed``); a difference anywhere else makes it another run.
RESUMABLE_PREFIXES = (
    "train.max_epochs",
    "train.max_steps",
    "train.lr",
    "train.weight_decay",
    "train.grad_clip",
    "train.precision",
    "train.accelerator",
    "train.devices",
    "train.log_every_n_steps",
    "train.checkpoint_every_n_steps",
    "train.val_check_interval",
    "train.check_val_every_n_epoch",
    "train.deterministic",
    "train.progress_bar",
    "train.cast_once",
    "train.bucket_rows",
    "train.cuda_graphs",
    "train.graph_warmup",
    "train.log_checkpoint",
    "train.tracking_uri",
    "train.out_dir",
    "model.kernels.",
    "data.pin_memory",
    "data.cache_bytes",
    "transfer.shared_dims",
    "parallel.",
)
# ``parallel.*`` degrees may change (a DCP checkpoint reshards); switching the strategy on or off may not.
IDENTITY_KEYS = ("parallel.enabled",)


class RunConflict(ConfigError):
    """The run directory holds another run, or another process is training it."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": 1e-3}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def identity_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Keys (flattened) where ``wanted`` trains something other than ``saved``; empty for the same run."""
    old, new = flatten(json.loads(json.dumps(saved))), flatten(json.loads(json.dumps(wanted)))
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return [k for k in keys if k in IDENTITY_KEYS or not k.startswith(RESUMABLE_PREFIXES)]


def describe(keys: list[str], saved: dict[str, Any], wanted: dict[str, Any], limit: int = 4) -> str:
    old, new = flatten(saved), flatten(wanted)
    shown = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return "; ".join(shown) + more


def saved_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunConflict(f"{path}: unreadable run config ({exc}); remove {run_dir} to start over") from exc


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` already belongs to a run (its config, MLflow id or a checkpoint is there)."""
    checkpoints = run_dir / "checkpoints"
    return (
        (run_dir / RUN_CONFIG_FILE).is_file()
        or (run_dir / RUN_ID_FILE).is_file()
        or (checkpoints.is_dir() and any(checkpoints.iterdir()))
    )


def check_same_run(run_dir: Path, wanted: dict[str, Any], *, resume: bool) -> None:
    """Refuse (:class:`RunConflict`) to train ``wanted`` in ``run_dir`` when that would replace another run.

    With ``resume`` the directory's run continues when its config matches up to :data:`RESUMABLE_PREFIXES`;
    without it any existing run is refused.
    """
    if not holds_run(run_dir):
        return
    name = wanted.get("name", run_dir.name)
    if not resume:
        raise RunConflict(
            f"{run_dir} already holds a run; continue it without --no-resume, give this one another name "
            f"(name={name}-2), or remove {run_dir}"
        )
    saved = saved_config(run_dir)
    if saved is None:
        return
    differences = identity_differences(saved, wanted)
    if differences:
        raise RunConflict(
            f"{run_dir} holds a run of another config ({describe(differences, saved, wanted)}); give this one "
            f"another name (name={name}-2) or remove {run_dir}"
        )


def record_config(run_dir: Path, config: dict[str, Any]) -> bool:
    """Write the run's config beside its checkpoints (once, when the run starts); whether it was written now."""
    if (run_dir / RUN_CONFIG_FILE).is_file():
        return False
    atomic_write_text(run_dir / RUN_CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True))
    return True


def remove_stale_temps(run_dir: Path) -> list[Path]:
    """Delete the temp files an interrupted atomic write left (``.<name>.*.tmp``) in the run directory and
    ``checkpoints/``; only safe while holding :func:`train_lock`. Returns what was removed."""
    removed = []
    for directory in (run_dir, run_dir / "checkpoints"):
        if directory.is_dir():
            for path in directory.glob(".*.tmp"):
                if path.is_file():
                    path.unlink(missing_ok=True)
                    removed.append(path)
    return removed


@contextmanager
def train_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir/.lock`` while training; a second process on the same run is refused at once.

    A POSIX record lock (``lockf``), not ``flock``: the data loader's forked workers would inherit an ``flock``
    and hold the run locked after the trainer itself was killed, until each noticed and exited; a record lock
    belongs to the process that took it and ends with it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise RunConflict(f"{run_dir} is being trained by another process; wait for it or stop it") from exc
        yield
    finally:
        os.close(fd)
