"""Tile configs of the attention kernels: the autotuner's lists and the pick a launch takes without tuning.

Autotuning compiles and times every config of a kernel variant at the first call of each tuning key,
on the critical path of a run's first steps. A launch therefore takes, in order:

1. the pick it made before for the same kernel, dtype and tuning key (a dict lookup);
2. the checked-in pick for this GPU and Triton version (``tuned_configs.json`` beside this module,
   written by ``experiments/bench_jagged_attention.py --write-tuned``): the entry of the same
   variant whose length buckets are nearest, so a tuned variant covers every length;
3. with autotuning on (``GEM_KERNELS_AUTOTUNE``, default on), a tuning run; off, the variant's
   heuristic, the first config of its list (one compile, no timing).

Each list holds ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; its first entry is the heuristic. The
biased variants have tiles of their own: the per-score bias work needs registers (tiles chosen by the
registers and spills of their compiled code, docs/benchmarks.md). The biased dQ pass needs
``BLOCK_M >= BLOCK_N`` (the deterministic position rows' window) and ``BLOCK_M >= 16 * num_warps`` (one owner
per element for its scatter, :func:`kernels.triton.bias.scatter_add`; whole 16-row groups for the position
gradient, :func:`kernels.triton.bias.add_position_grad`). Float32 inputs take small tiles of their own, biased or
not: the 16-bit lists' tiles and pipeline stages need more shared memory at 4 bytes per element than an SM has
(the forward's 256x64 tile in 3 stages at head dim 128: 320 KiB against Hopper's 227).
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch
import triton

TUNED_PATH = Path(__file__).with_name("tuned_configs.json")

# The autotuner's key: a variant (flags, head dims) and buckets of the longest and the mean length.
TUNE_KEY = ["N_BUCKET", "AVG_BUCKET", "DQK", "DV", "ACT", "CAUSAL", "HAS_TARGETS", "HAS_WINDOW", "HAS_PB", "HAS_TB"]
_LENGTH_KEYS = ("N_BUCKET", "AVG_BUCKET")


# The variant ("plain" or "biased") each listed config serves, by object id. Kept off the config itself:
# Triton's autotuning disk cache (TRITON_CACHE_AUTOTUNING=1) rebuilds configs from their attributes.
_TAGS: dict[int, str] = {}


def _configs(plain: list[tuple], biased: list[tuple], fp32: list[tuple]) -> list[triton.Config]:
    """Tuples as configs, tagged by the variants they serve."""
    out = []
    for tag, rows in (("plain", plain), ("biased", biased), ("fp32", fp32)):
        for bm, bn, warps, stages in rows:
            config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
            _TAGS[id(config)] = tag
            out.append(config)
    return out


FWD_CONFIGS = _configs(
    plain=[(256, 64, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
    biased=[(128, 64, 8, 3), (128, 32, 4, 3)],
    fp32=[(64, 32, 4, 2), (32, 32, 4, 2)],
)
DQ_CONFIGS = _configs(
    plain=[(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3)],
    biased=[(128, 32, 8, 2), (64, 32, 4, 2)],
    fp32=[(64, 32, 4, 2), (32, 32, 2, 2)],
)
DKDV_CONFIGS = _configs(
    plain=[(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3)],
    biased=[(64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
    fp32=[(32, 64, 4, 2), (32, 32, 4, 2)],
)


def biased_dq_ok(config: triton.Config) -> bool:
    """Whether the biased dQ pass can run ``config`` (module doc)."""
    return config.kwargs["BLOCK_M"] >= max(config.kwargs["BLOCK_N"], 16 * config.num_warps)


assert all(biased_dq_ok(c) for c in DQ_CONFIGS if _TAGS[id(c)] in ("biased", "fp32"))


def configs_for(configs: list[triton.Config], meta: dict, dtype: torch.dtype) -> list[triton.Config]:
    """The configs of ``configs`` that serve this variant (float32 inputs; else biased or not) of inputs of
    ``dtype``; the first is its heuristic."""
    if dtype == torch.float32:
        tag = "fp32"
    else:
        tag = "biased" if meta.get("HAS_PB") or meta.get("HAS_TB") else "plain"
    return [c for c in configs if _TAGS.get(id(c)) == tag]


def prune(configs: list[triton.Config], named_args: dict, **meta) -> list[triton.Config]:
    return configs_for(configs, meta, named_args["Q"].dtype)


def device_key(device: torch.device) -> str:
    """The checked-in table's key: GPU name and Triton major.minor."""
    major_minor = ".".join(triton.__version__.split(".")[:2])
    return f"{torch.cuda.get_device_name(device)} | triton {major_minor}"


def entry_key(kernel: str, dtype: torch.dtype, key_names: list[str], meta: dict) -> str:
    """One table entry's key: kernel, dtype and tuning-key values, ``name=value`` joined by ``,``."""
    return ",".join([kernel, str(dtype).removeprefix("torch."), *(f"{n}={meta[n]}" for n in key_names)])


def _split(entry: str) -> tuple[str, dict[str, str]]:
    """(the key without the length buckets, the length buckets) of an entry key."""
    fields = entry.split(",")
    lengths = {}
    rest = []
    for field in fields:
        name, _, value = field.partition("=")
        if name in _LENGTH_KEYS:
            lengths[name] = value
        else:
            rest.append(field)
    return ",".join(rest), lengths


@functools.cache
def _table(path: str, device: str) -> dict[str, list[tuple[dict[str, int], triton.Config]]]:
    """The checked-in picks for ``device``, by variant (entry key without length buckets)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        picks = json.load(f).get(device, {})
    table: dict[str, list] = {}
    for entry, (bm, bn, warps, stages) in picks.items():
        variant, lengths = _split(entry)
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        biased = "HAS_PB=True" in variant or "HAS_TB=True" in variant
        if variant.startswith("_bwd_dq_kernel,") and biased and not biased_dq_ok(config):
            raise ValueError(f"{path}: entry {entry!r} of {device!r}: the biased dQ pass needs "
                             f"BLOCK_M >= max(BLOCK_N, 16 * num_warps), got {[bm, bn, warps, stages]}")
        table.setdefault(variant, []).append(({k: int(v) for k, v in lengths.items()}, config))
    return table


def checked_in_pick(device: torch.device, entry: str) -> triton.Config | None:
    """The checked-in config of the entry's variant whose length buckets are nearest (log scale)."""
    variant, lengths = _split(entry)
    candidates = _table(str(TUNED_PATH), device_key(device)).get(variant)
    if not candidates:
        return None

    def distance(item):
        return sum(abs(math.log2(item[0][k]) - math.log2(int(v))) for k, v in lengths.items())

    return min(candidates, key=distance)[1]


def write_tuned(picks: dict[str, triton.Config], device: torch.device, path: Path = TUNED_PATH) -> None:
    """Adds ``picks`` (entry key -> config) to the table under this device's key; writes atomically."""
    table = json.loads(path.read_text()) if path.exists() else {}
    section = table.setdefault(device_key(device), {})
    for entry, c in sorted(picks.items()):
        section[entry] = [c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    _table.cache_clear()
