"""Serving latency of a student value model: p50/p95/p99 per serving form and candidate count, one CPU thread.

The benchmark is :func:`value_models.bench.run_bench` (module doc there); this script and ``gem
bench-serving`` take the same arguments.

    python -m experiments.bench_serving --ckpt runs/student-default/checkpoints/last.ckpt --store store \\
        --json serving.json
"""

from __future__ import annotations

import argparse

from gem.cli import add_bench_serving_arguments, bench_serving


def build_arg_parser() -> argparse.ArgumentParser:
    """The script's arguments, the same as ``gem bench-serving`` 's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_serving_arguments(parser)
    return parser


if __name__ == "__main__":
    bench_serving(build_arg_parser().parse_args())
