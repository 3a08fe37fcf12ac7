"""Count what the attention kernels compile to, without a GPU: registers, spills and SASS per score.

Each kernel variant is compiled for sm_90 by Triton's own toolchain (``triton.compile`` with a CUDA
target, ptxas bundled with Triton), then ``cuobjdump -res-usage`` gives registers and stack (spills)
and ``nvdisasm`` the SASS. Each kernel has two tile loops (loops holding ``HGMMA``s), one over the
mask-free tiles and one over the masked tiles at the diagonal, laid out in the order the kernel calls
them (:data:`LOOP_ORDER`); a loop's instruction count divided by the scores each thread owns per tile is
its elementwise cost per score. Counts are static: a branch inside a loop counts as if always taken.
(Picking "the shortest loop" instead named the masked loop of the biased dQ pass once a change made it
the shorter one, docs/benchmarks.md.)
Run it with the Triton of the GPU machine first on ``PYTHONPATH`` (e.g. ``pip install --target DIR
triton==3.6.0``); the counts differ between Triton versions.

    PYTHONPATH=DIR:. python experiments/kernel_sass.py --kernels fwd dq dkdv --bias both
    PYTHONPATH=DIR:. python experiments/kernel_sass.py --kernels dq --bias both --maxnreg 168   # registers capped

``--glue`` reports the glue kernels' backward instead (registers, spills and how many programs an SM holds at each
launch shape of ``experiments/bench_glue.py --launches``): memory-bound kernels are slowed by too few warps in
flight (docs/benchmarks.md, session 33).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from experiments.bench_glue import LAUNCH_SHAPES
from kernels.triton import jagged_attention as attn
from kernels.triton import layer_norm as triton_layer_norm
from kernels.triton import row_modulate as triton_row_modulate
from kernels.triton import silu_split as triton_silu_split
from kernels.triton.configs import DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS, configs_for
from kernels.triton.time_tiles import TILE_K_GPU, TILE_Q_GPU

KERNELS = {"fwd": (attn._fwd_kernel, FWD_CONFIGS), "dq": (attn._bwd_dq_kernel, DQ_CONFIGS),
           "dkdv": (attn._bwd_dkdv_kernel, DKDV_CONFIGS)}
FP32_POINTERS = {"LSE", "DELTA", "PB", "TB", "DPB", "DTB"}
I32_POINTERS = {"ORDER", "TS", "QTS", "INFO", "FLAGS"}
I64_POINTERS = {"Q_OFF", "KV_OFF", "NT"}
FLOATS = {"alpha", "inv_n"}
SHOWN = ["HGMMA", "MUFU", "LDG", "LDS", "STS", "REDG", "SHFL", "BAR", "STL", "LDL"]
# The kernels' tile loops in the order their sources call them (kernels/triton/jagged_attention.py), without and
# with the far tiles of a position table shorter than the sequences (the dQ pass compiles that loop for any table).
LOOP_ORDER = {"fwd": ("mask-free", "masked"), "dq": ("mask-free", "masked"), "dkdv": ("masked", "mask-free")}
FAR_LOOP_ORDER = {"fwd": ("far", "mask-free", "masked"), "dq": ("far", "mask-free", "masked"),
                  "dkdv": ("masked", "mask-free", "far")}
# The dQ pass's far tiles of the plan's width (kernels/triton/time_tiles.py) come first, in a loop of their own.
PLANNED_LOOP_ORDER = {"fwd": (), "dq": ("planned", "far", "mask-free", "masked"), "dkdv": ()}


def signature(fn, constexprs: dict) -> tuple[dict, dict]:
    """Argument types (bf16 tensors, float32 tables, int32 times and order, int64 offsets) and 16-divisibility hints."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name[0].islower() or name in (
            "P_SIZE", "T_SIZE", "H", "N_BUCKET", "AVG_BUCKET", "ROWS", "REPS", "L_Q", "L_KV", "OFF", "LD", "NQB", "NKT",
            "L_K", "NKB", "NQT",
        ):
            sig[name] = "i32"
        else:
            sig[name] = "*fp32" if name in FP32_POINTERS else "*i64" if name in I64_POINTERS else "*i32" if name in I32_POINTERS else "*bf16"
        if sig[name].startswith("*") or (name.startswith("stride_") and name not in fn.do_not_specialize):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_sm90(fn, constexprs: dict, config: triton.Config):
    sig, attrs = signature(fn, constexprs)
    source = triton.compiler.ASTSource(fn, sig, constexprs, attrs)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def tile_loops(sass: str) -> list[collections.Counter]:
    """Instruction counts of each innermost loop (backward branch to a label) holding HGMMAs, in program order."""
    lines = sass.splitlines()
    labels, bodies = {}, []
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if branch and branch.group(1) in labels:
            ops = collections.Counter()
            for body_line in lines[labels[branch.group(1)]: i + 1]:
                op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body_line)
                if op:
                    ops[op.group(2).split(".")[0]] += 1
            if ops["HGMMA"]:
                bodies.append((labels[branch.group(1)], i, ops))
    # Innermost only: a loop around another (e.g. over a pipelined loop's prologue) is not a tile loop.
    inner = [b for b in bodies if not any(b[0] <= o[0] and o[1] <= b[1] and o is not b for o in bodies)]
    return [ops for _, _, ops in sorted(inner, key=lambda body: body[0])]


def loop_line(name: str, loop: collections.Counter, scores: float) -> str:
    total = sum(loop.values())
    shown = " ".join(f"{k}={loop[k]}" for k in SHOWN if loop[k])
    return f"{name} {total} instr, {total / scores:.1f}/score ({shown})"


def tools(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resource_usage(compiled) -> tuple[int, int, str]:
    """``(registers per thread, stack bytes, SASS text)`` of a kernel compiled for sm_90."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tools("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tools("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)), sass


def report(kernel: str, bias: str, act: int, config: triton.Config, deterministic: bool = False,
           full_table: bool = False, split: bool = True) -> str:
    """One variant's registers, stack and tile loops; ``full_table``: a position table with an entry for every
    distance (HSTU's; ``POS_FITS``), else the ``large`` teacher's ``position_window`` table; ``split``: the forward's
    and dK/dV's planned time buckets (:mod:`kernels.triton.time_tiles`), whose branch their mask-free loops then hold
    beside the per-score buckets (both counted)."""
    fn, _ = KERNELS[kernel]
    constexprs = dict(ACT=act, CAUSAL=True, HAS_TARGETS=True, HAS_WINDOW=False, HAS_PB=bias != "none",
                      HAS_TB=bias != "none", POS_FITS=bias != "none" and full_table, FAST=True, PTX=True, DQK=128,
                      DV=128, BLOCK_DQK=128, BLOCK_DV=128, **config.kwargs)
    constexprs["SPLIT"] = split and bias != "none"
    constexprs["COMPACT"] = False
    if kernel == "dkdv":
        constexprs.update(TILE_KB=TILE_Q_GPU, TILE_QT=TILE_K_GPU)
    else:
        constexprs.update(TILE_Q=TILE_Q_GPU, TILE_K=TILE_K_GPU)
    if kernel == "fwd":
        constexprs["TMA"] = True
    if kernel == "dq":
        del constexprs["POS_FITS"]
        # The teacher's 128-entry time table (kernels/triton/bias.py: sum_time_grad).
        constexprs.update(DETERMINISTIC=deterministic and bias != "none", BLOCK_T=128 if deterministic else 16)
    regs, stack, sass = resource_usage(compile_sm90(fn, constexprs, config))
    loops = tile_loops(sass)
    names = next((order[kernel] for order in (LOOP_ORDER, FAR_LOOP_ORDER, PLANNED_LOOP_ORDER)
                  if len(order[kernel]) == len(loops)), [f"loop {i}" for i in range(len(loops))])
    scores = config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] / (32 * config.num_warps)
    planned = config.kwargs["BLOCK_M"] * constexprs.get("TILE_K", 0) / (32 * config.num_warps)
    parts = " | ".join(loop_line(name, loop, planned if name == "planned" else scores)
                       for name, loop in zip(names, loops, strict=True))
    kernel = f"{kernel}-det" if constexprs.get("DETERMINISTIC") else kernel
    return (f"{kernel:6s} bias={bias:4s} act={act} {config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} "
            f"w{config.num_warps} s{config.num_stages}: regs {regs} stack {stack}, "
            f"{resident_programs(regs, config.num_warps)} programs per SM | {parts}")


# The glue kernels' backward as the `large` teacher launches them (bf16 stream and activations, width 1,024), at each
# launch shape `experiments/bench_glue.py --launches` times: registers bound how many programs an SM holds.
GLUE_FLOAT32 = {"w_ptr", "b_ptr", "gb_ptr", "mean_ptr", "rstd_ptr", "partial_ptr", "group_ptr", "sums_ptr", "db_ptr"}
_LN_OFF = dict(HAS_GATE=False, GATE_SILU=False, HAS_GATE_BIAS=False, HAS_DROPOUT=False, HAS_STREAM_GRAD=False,
               HAS_RESIDUAL=False, HAS_BRANCH_BIAS=False, ATOMIC_TOTALS=True, GROUP=triton_layer_norm.BWD_GROUP,
               SUMS=3, BLOCK_N=1024)
GLUE_CASES = {
    "layer_norm": [
        ("residual", triton_layer_norm._ln_bwd_kernel, set(),
         dict(_LN_OFF, HAS_STREAM_GRAD=True, HAS_BRANCH_BIAS=True)),
        ("gated", triton_layer_norm._ln_bwd_kernel, set(),
         dict(_LN_OFF, HAS_GATE=True, GATE_SILU=True, HAS_GATE_BIAS=True)),
    ],
    "silu_split": [("bias", triton_silu_split._silu_bwd_kernel, set(),
                    dict(HAS_BIAS=True, ATOMIC_TOTALS=True, GROUP=triton_silu_split.GROUP))],
    "silu_modulate": [("bias", triton_row_modulate._modulate_bwd_kernel, set(),
                       dict(HAS_BIAS=True, HAS_DROPOUT=False, CHUNK_TILES=triton_row_modulate.CHUNK_TILES))],
}
SM_REGISTERS, SM_THREADS, SM_PROGRAMS = 65536, 2048, 32


def glue_signature(fn, constexprs: dict, float32_tensors: set) -> tuple[dict, dict]:
    """``*_ptr`` arguments bf16 unless float32 (:data:`GLUE_FLOAT32` and the case's own) or bytes, counters and
    offsets; scale-like arguments float32; the rest int32, the width and row strides divisible by 16 as the launch
    specialises them (the loads' vector width follows)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            special = {"m_ptr": "*u8", "count_ptr": "*i32", "offsets_ptr": "*i64", "chunk_row_ptr": "*i64",
                       "chunk_first_ptr": "*i64"}
            fp32 = name in GLUE_FLOAT32 or name in float32_tensors
            sig[name] = special.get(name, "*fp32" if fp32 else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in ("scale", "keep_scale", "eps", "scale_offset") else "i32"
            if name == "N" or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def resident_programs(registers: int, warps: int) -> int:
    """Programs of ``warps`` warps one sm_90 SM holds at once at ``registers`` per thread (allocated in eights),
    bounded by its registers, threads and program slots."""
    threads = 32 * warps
    return min(SM_REGISTERS // (-(-registers // 8) * 8 * threads), SM_THREADS // threads, SM_PROGRAMS)


def glue_report(kernel: str, shape: dict) -> list[str]:
    """Registers, stack and resident programs per SM of ``kernel``'s backward at one launch shape."""
    lines = []
    warps = shape.get("BWD_WARPS", shape.get("NUM_WARPS"))
    blocks = {k: v for k, v in shape.items() if k.startswith("BLOCK_")}
    if "BWD_ROWS" in shape:  # the norm's launch caps its warps by the row's width, as the real launch does
        blocks.update(ROWS=shape["BWD_ROWS"], STAGES=shape["BWD_STAGES"])
        warps = min(warps, triton_layer_norm._num_warps(_LN_OFF["BLOCK_N"]))
    if "STAGES" in shape:
        blocks["STAGES"] = shape["STAGES"]
    for case, fn, float32_tensors, flags in GLUE_CASES[kernel]:
        constexprs = {**flags, **blocks}
        sig, attrs = glue_signature(fn, constexprs, float32_tensors)
        compiled = triton.compile(triton.compiler.ASTSource(fn, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        regs, stack, _ = resource_usage(compiled)
        resident = resident_programs(regs, warps)
        text = " ".join(f"{k}={v}" for k, v in shape.items())
        lines.append(f"{kernel} {case:8s} {text:64s} regs {regs:3d} stack {stack:3d} smem {compiled.metadata.shared:6d}: "
                     f"{resident} programs ({resident * warps} warps) per SM")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--bias", nargs="+", choices=["none", "both"], default=["none", "both"])
    parser.add_argument("--acts", type=int, nargs="+", default=[1], help="1 SiLU, 0 softmax")
    parser.add_argument("--deterministic", action="store_true",
                        help="the biased dQ kernel as GEM_KERNELS_DETERMINISTIC=1 compiles it")
    parser.add_argument("--full-position-table", action="store_true",
                        help="a position table with an entry for every distance (HSTU's) instead of the large "
                             "teacher's position_window table, whose far tiles run a loop of their own")
    parser.add_argument("--no-split-time", action="store_true",
                        help="without the split time buckets (kernel switch time_tiles off)")
    parser.add_argument("--maxnreg", type=int, default=None,
                        help="cap the attention kernels' registers per thread (Triton's maxnreg), to see the spills")
    parser.add_argument("--glue", action="store_true",
                        help="instead: the glue kernels' backward at bench_glue's LAUNCH_SHAPES (registers, residency)")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90")
    if args.glue:
        for kernel, (_, shapes) in LAUNCH_SHAPES.items():
            for shape in shapes:
                print("\n".join(glue_report(kernel, shape)), flush=True)
        return 0
    for kernel in args.kernels:
        for bias in args.bias:
            for act in args.acts:
                for config in configs_for(KERNELS[kernel][1], {"HAS_PB": bias != "none"}, torch.bfloat16):
                    if args.maxnreg:
                        config = triton.Config(config.kwargs, num_warps=config.num_warps,
                                               num_stages=config.num_stages, maxnreg=args.maxnreg)
                    print(report(kernel, bias, act, config, args.deterministic, args.full_position_table,
                                 not args.no_split_time),
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
