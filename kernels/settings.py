"""Process-wide kernel switches: a config dataclass, applied once, with environment overrides.

A run sets them through its config (``model.kernels.*``), applied when the model is built
(:func:`apply_kernel_settings`); the kernels read the effective value of each switch at every call.
An environment variable, when set, overrides its field for the whole process (e.g. to benchmark one
backend against another without touching a config); :func:`effective_kernel_settings` and
:func:`kernel_environment` report both, so every run can log what its kernels really did.

==================  ============================  =====================================================
field               environment variable          meaning
==================  ============================  =====================================================
``backend``         ``GEM_ATTENTION_BACKEND``     what ``backend="auto"`` calls run: ``auto`` (Triton on
                                                  CUDA, the reference elsewhere), ``pytorch``, ``triton``
``deterministic``   ``GEM_KERNELS_DETERMINISTIC`` bitwise-repeatable Triton backward: bias-table gradients
                                                  by per-program rows, LayerNorm parameter gradients by
                                                  groups summed in order, no float atomics, no
                                                  autotuning (``0``/``1``)
``tma``             ``GEM_KERNELS_TMA``           TMA descriptor loads; None: on CUDA (Hopper+), off in
                                                  the interpreter (``0``/``1``)
``autotune``        ``GEM_KERNELS_AUTOTUNE``      autotune Triton configs; off: each kernel's first
                                                  config (quick compiles for checks) (``0``/``1``)
``fast_sigmoid``    ``GEM_KERNELS_FAST_SIGMOID``  the approximate ``tanh.approx`` sigmoid on CUDA
                                                  (``0``/``1``)
``glue_backend``    ``GEM_GLUE_BACKEND``          what ``backend="auto"`` calls of :mod:`kernels.glue`
                                                  (fused LayerNorm, row modulation) run, as ``backend``
``time_tiles``      ``GEM_KERNELS_TIME_TILES``    the attention's time buckets planned once per batch and
                                                  split per row (:mod:`kernels.triton.time_tiles`);
                                                  off: every score takes its own (``0``/``1``)
``compact_grid``    ``GEM_KERNELS_COMPACT_GRID``  the attention's programs only for row blocks that hold
                                                  rows (:mod:`kernels.triton.work_list`); off: one per
                                                  block of the longest sequence, per sequence (``0``/``1``)
``split_keys``      ``GEM_KERNELS_SPLIT_KEYS``    softmax cross-attention of a few queries over long key
                                                  rows on key chunks (:mod:`kernels.triton.split_keys`);
                                                  off: one program per (sequence, head) (``0``/``1``)
==================  ============================  =====================================================
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

BACKENDS = ("auto", "pytorch", "triton")
ENVIRONMENT = {
    "backend": "GEM_ATTENTION_BACKEND",
    "deterministic": "GEM_KERNELS_DETERMINISTIC",
    "tma": "GEM_KERNELS_TMA",
    "autotune": "GEM_KERNELS_AUTOTUNE",
    "fast_sigmoid": "GEM_KERNELS_FAST_SIGMOID",
    "glue_backend": "GEM_GLUE_BACKEND",
    "time_tiles": "GEM_KERNELS_TIME_TILES",
    "compact_grid": "GEM_KERNELS_COMPACT_GRID",
    "split_keys": "GEM_KERNELS_SPLIT_KEYS",
}
_FLAGS = {"0": False, "1": True}


@dataclass
class KernelSettings:
    """The kernel switches of a run (module doc)."""

    backend: str = "auto"
    deterministic: bool = False
    tma: bool | None = None
    autotune: bool = True
    fast_sigmoid: bool = True
    glue_backend: str = "auto"
    time_tiles: bool = True
    compact_grid: bool = True
    split_keys: bool = True

    def __post_init__(self) -> None:
        for field in ("backend", "glue_backend"):
            if getattr(self, field) not in BACKENDS:
                raise ValueError(f"kernels.{field} must be one of {BACKENDS}, got {getattr(self, field)!r}")


_applied = KernelSettings()


def apply_kernel_settings(settings: KernelSettings) -> None:
    """Make ``settings`` the process's kernel switches (environment variables still override them)."""
    global _applied
    _applied = dataclasses.replace(settings)


def _override(field: str) -> str | None:
    return os.environ.get(ENVIRONMENT[field])


def _flag(field: str, configured: bool | None) -> bool | None:
    raw = _override(field)
    if raw is None:
        return configured
    if raw not in _FLAGS:
        raise ValueError(f"{ENVIRONMENT[field]} must be 0 or 1, got {raw!r}")
    return _FLAGS[raw]


def _choice(field: str) -> str:
    raw = _override(field)
    if raw is None:
        return getattr(_applied, field)
    if raw not in BACKENDS:
        raise ValueError(f"{ENVIRONMENT[field]} must be one of {BACKENDS}, got {raw!r}")
    return raw


def backend() -> str:
    """The effective ``backend`` switch."""
    return _choice("backend")


def glue_backend() -> str:
    """The effective ``glue_backend`` switch."""
    return _choice("glue_backend")


def resolve_backend(requested: str, forced: str, on_cuda: bool) -> str:
    """The backend a call runs: ``requested`` unless it is ``auto``; then ``forced`` (a switch) unless that
    is ``auto`` too; then Triton on CUDA tensors and the PyTorch reference elsewhere."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested != "auto":
        return requested
    if forced != "auto":
        return forced
    return "triton" if on_cuda else "pytorch"


def deterministic() -> bool:
    """The effective ``deterministic`` switch."""
    return _flag("deterministic", _applied.deterministic)


def tma() -> bool | None:
    """The effective ``tma`` switch (None: by device)."""
    return _flag("tma", _applied.tma)


def autotune() -> bool:
    """The effective ``autotune`` switch."""
    return _flag("autotune", _applied.autotune)


def fast_sigmoid() -> bool:
    """The effective ``fast_sigmoid`` switch."""
    return _flag("fast_sigmoid", _applied.fast_sigmoid)


def time_tiles() -> bool:
    """The effective ``time_tiles`` switch."""
    return _flag("time_tiles", _applied.time_tiles)


def compact_grid() -> bool:
    """The effective ``compact_grid`` switch."""
    return _flag("compact_grid", _applied.compact_grid)


def split_keys() -> bool:
    """The effective ``split_keys`` switch."""
    return _flag("split_keys", _applied.split_keys)


def effective_kernel_settings() -> KernelSettings:
    """The switches the kernels use now: the applied settings with the environment's overrides."""
    return KernelSettings(
        backend=backend(),
        deterministic=deterministic(),
        tma=tma(),
        autotune=autotune(),
        fast_sigmoid=fast_sigmoid(),
        glue_backend=glue_backend(),
        time_tiles=time_tiles(),
        compact_grid=compact_grid(),
        split_keys=split_keys(),
    )


def kernel_environment() -> dict[str, str]:
    """The override variables set in this process, by name (empty when none is)."""
    return {name: os.environ[name] for name in ENVIRONMENT.values() if name in os.environ}
