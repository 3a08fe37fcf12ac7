"""Per-rank work of context parallelism: tokens, and causal attention query-key pairs, against one device.

Usage::

    python -m experiments.bench_context_parallel --cp 2 4 8 --rows 64 --max-len 4096 --seed 0

Draws ``--rows`` sequence lengths (uniform in ``[1, --max-len]``), lays them out with
:func:`foundation.parallel.context.zigzag_shard` for each cp degree, and reports for the heaviest
rank, as a fraction of the whole batch (1.0 = no saving; ``1/cp`` = ideal):

- ``tokens``: the tokens it holds (linear work and activations of the sharded blocks);
- ``attention_needed``: the causal pairs of its own queries (what a kernel whose queries may start
  mid-sequence would compute; zigzag evens this);
- ``attention_computed``: the causal pairs of its prefix sequences, which is what
  ``kernels.jagged_attention`` computes today (queries from position 0 to its last own token).

Pure arithmetic on the layout (no processes, no timing), so the figures are exact and machine-free.
Results are in ``docs/benchmarks.md`` ("Context parallelism").
"""

from __future__ import annotations

import argparse
import json

import torch

from foundation.parallel.context import build_context_plan, causal_work


def causal_pairs(lengths: torch.Tensor) -> int:
    """Query-key pairs of whole sequences of ``lengths`` under a causal mask."""
    return int((lengths * (lengths + 1) // 2).sum())


def heaviest_rank_shares(lengths: torch.Tensor, cp: int) -> dict[str, float]:
    """The heaviest rank's tokens, needed and computed attention pairs, as fractions of the whole batch's."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total_tokens, total_pairs = int(lengths.sum()), causal_pairs(lengths)
    tokens, needed, computed = [], [], []
    for rank in range(cp):
        plan = build_context_plan(offsets, cp, rank)
        prefixes = plan.prefixes(causal=True)
        tokens.append(plan.mine.token_index.numel())
        needed.append(causal_work(plan.mine))
        computed.append(causal_pairs(prefixes.offsets[1:] - prefixes.offsets[:-1]))
    return {
        "tokens": max(tokens) / total_tokens,
        "attention_needed": max(needed) / total_pairs,
        "attention_computed": max(computed) / total_pairs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(1, args.max_len + 1, (args.rows,), generator=g)
    for cp in args.cp:
        print(json.dumps({"cp": cp, "ideal": round(1 / cp, 4), **{
            k: round(v, 4) for k, v in heaviest_rank_shares(lengths, cp).items()
        }}))


if __name__ == "__main__":
    main()
