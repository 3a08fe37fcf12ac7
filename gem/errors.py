"""User-facing errors of the composition root; ``gem`` prints each as one line (exit code 2)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A run that produced no trained model (e.g. no usable training rows); the message says why."""


class ResumeError(ValueError):
    """A checkpoint that cannot resume this run: its parameters do not fit this run's model."""


class ModelRoleError(ValueError):
    """A checkpoint of the wrong kind for the command, e.g. a value model where a teacher is needed."""
