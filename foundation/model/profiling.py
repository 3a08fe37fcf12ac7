"""Named profiler ranges around the teacher's parts, for the kernel-time breakdown of a training step.

``experiments/bench_teacher.py --profile N`` attributes every kernel launched inside a range to its
part, and every backward kernel to the part whose forward op created its autograd node (the
profiler's sequence numbers link the two). Outside a profiler the ranges cost nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

GENERATIVE = "gem.generative"
ATTENTION = "gem.attention"
EMBEDDINGS = "gem.embeddings"
REGIONS = (GENERATIVE, ATTENTION, EMBEDDINGS)


def profile_region(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range called ``name`` while a profiler runs, else a no-op context."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
