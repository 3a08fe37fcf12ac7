"""The glue kernels on the GPU: checked against their PyTorch references, then timed against them.

``kernels.layer_norm`` (``LN(scale * x) * gate`` in the next GEMM's dtype), ``kernels.residual_layer_norm``
(``s = x + branch + branch_bias``, ``LN(s)``: a block's output and its projection's bias joining the float32 stream,
both outputs read on) and ``kernels.jagged_silu_modulate`` (``silu(h) * scale[row] + shift[row]``) at the ``large``
teacher's shapes: 16,384 tokens, d_model 1,024 (the attention norm and the PFFN's hidden width), bf16 inputs as
autocast hands them over. Each case runs forward and backward on both backends in one process, reports
the relative error of the output and of every gradient (fresh random inputs per case), then the median
time of forward and of forward+backward over repeated runs (``triton.testing.do_bench``), and the
bytes each Triton pass must move over its time against the copy bandwidth.

    python -m experiments.bench_glue --json glue.json

``--launches`` instead times each backward alone (one recorded forward, its backward replayed) at the launch shapes
of :data:`LAUNCH_SHAPES`, the committed one first, set through the kernel modules' constants, with the largest
relative difference of its gradients from the committed shape's (the sums' order changes), as a wall time (host
included) and as its device kernels' time from the profiler, which is what a CUDA-graphed step pays and the rate is
taken from (a small backward's wall time is mostly the host's launches): memory-bound kernels
whose registers limit how many programs an SM holds move their bytes slower (docs/benchmarks.md, session 33), and
``python experiments/kernel_sass.py --glue`` counts those registers without a GPU.

    python -m experiments.bench_glue --launches --json launches.json

On CPU it runs the same code at tiny shapes through the Triton interpreter (``TRITON_INTERPRET=1``),
which checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from experiments.kernel_groups import profile_calls
from foundation.data.io import atomic_write_text
from kernels import jagged_silu_modulate, layer_norm, residual_layer_norm, silu_split
from kernels.glue import SiluGate
from kernels.triton import layer_norm as triton_layer_norm
from kernels.triton import row_modulate as triton_row_modulate
from kernels.triton import silu_split as triton_silu_split


def _with_committed(module, alternatives: list[dict]) -> tuple:
    """``(module, shapes)``: the module's committed constants (those the alternatives set) first."""
    return module, [{name: getattr(module, name) for name in alternatives[0]}, *alternatives]


# Backward launch shapes to time, per kernel module: the committed constants first, then these.
LAUNCH_SHAPES = {
    "layer_norm": _with_committed(triton_layer_norm, [
        {"BWD_WARPS": 2, "BWD_PROGRAMS_PER_SM": 16, "BWD_ROWS": 1, "BWD_STAGES": 1},
        {"BWD_WARPS": 4, "BWD_PROGRAMS_PER_SM": 3, "BWD_ROWS": 2, "BWD_STAGES": 3},
        {"BWD_WARPS": 4, "BWD_PROGRAMS_PER_SM": 2, "BWD_ROWS": 2, "BWD_STAGES": 4},
        {"BWD_WARPS": 4, "BWD_PROGRAMS_PER_SM": 4, "BWD_ROWS": 1, "BWD_STAGES": 3},
    ]),
    "silu_split": _with_committed(triton_silu_split, [
        {"BLOCK_M": 16, "BLOCK_N": 128, "NUM_WARPS": 4}, {"BLOCK_M": 16, "BLOCK_N": 128, "NUM_WARPS": 2},
        {"BLOCK_M": 32, "BLOCK_N": 128, "NUM_WARPS": 8}, {"BLOCK_M": 8, "BLOCK_N": 256, "NUM_WARPS": 2},
    ]),
    "silu_modulate": _with_committed(triton_row_modulate, [
        {"BLOCK_L": 64, "BLOCK_N": 32, "NUM_WARPS": 4, "STAGES": 1},
        {"BLOCK_L": 64, "BLOCK_N": 32, "NUM_WARPS": 4, "STAGES": 3},
        {"BLOCK_L": 16, "BLOCK_N": 64, "NUM_WARPS": 2, "STAGES": 3},
        {"BLOCK_L": 32, "BLOCK_N": 64, "NUM_WARPS": 4, "STAGES": 4},
    ]),
}


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (0 when both are empty)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else float((a - b).norm().item())


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` in ms: CUDA events via do_bench on a GPU, the host clock elsewhere."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def layer_norm_case(tokens: int, width: int, device: torch.device, seed: int) -> dict:
    """Inputs of the HSTU attention norm: ``x``, ``gate`` bf16 ``[tokens, width]``, float32 affine."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    gate = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    bias = (0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    upstream = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16)

    def run(backend: str) -> torch.Tensor:
        return layer_norm(x, weight, bias, 1e-5, scale=0.5, gate=gate, out_dtype=torch.bfloat16, backend=backend)

    # Read x, gate, write out (2 bytes each); backward reads x, gate, dout, writes dx, dgate.
    bytes_fwd = 3 * tokens * width * 2
    return {"leaves": [x, gate, weight, bias], "names": ["x", "gate", "weight", "bias"], "run": run,
            "upstream": upstream, "bytes_fwd": bytes_fwd, "bytes_bwd": 5 * tokens * width * 2}


def silu_gate_norm_case(tokens: int, width: int, device: torch.device, seed: int) -> dict:
    """Inputs of the HSTU block's gated norm as the teacher runs it: ``x`` bf16 ``[tokens, width]`` gated by
    ``silu(pre + bias)`` (a :class:`~kernels.glue.SiluGate`: the projection's bf16 gate columns and their float32
    bias), float32 affine. ``pre`` is a tensor of its own here: as a view of a wider leaf its gradient would be
    scattered into that leaf by autograd (a zero fill and a copy of the whole projection's gradient, which the
    teacher's split never runs: the norm writes into the projection's gradient in place)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    pre = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    gate_bias = (0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    bias = (0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    upstream = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16)

    def run(backend: str) -> torch.Tensor:
        return layer_norm(x, weight, bias, 1e-5, gate=SiluGate(pre, gate_bias), out_dtype=torch.bfloat16,
                          backend=backend)

    # Backward reads x, the gate's pre-activation, dout; writes dx and the pre-activation's gradient (2 bytes each).
    return {"leaves": [x, pre, gate_bias, weight, bias], "names": ["x", "pre", "gate_bias", "weight", "bias"],
            "run": run, "upstream": upstream, "bytes_fwd": 3 * tokens * width * 2, "bytes_bwd": 5 * tokens * width * 2}


def residual_case(tokens: int, width: int, device: torch.device, seed: int,
                  stream_dtype: torch.dtype = torch.float32) -> dict:
    """Inputs of a block's residual norm: the stream ``x`` (float32, or bf16 as the teacher's default stream), the
    bf16 ``branch`` and its float32 bias; the sum and the bf16 norm both read downstream (one cotangent for the two,
    concatenated)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, width, device=device, generator=g).to(stream_dtype).requires_grad_(True)
    branch = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    branch_bias = (0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    bias = (0.1 * torch.randn(width, device=device, generator=g)).requires_grad_(True)
    upstream = torch.randn(tokens, 2 * width, device=device, generator=g).to(stream_dtype)

    def run(backend: str) -> torch.Tensor:
        total, normed = residual_layer_norm(
            x, branch, weight, bias, 1e-5, branch_bias=branch_bias, out_dtype=torch.bfloat16, backend=backend
        )
        return torch.cat([total, normed.to(total.dtype)], dim=1)

    # Forward reads x, the branch (2 bytes), writes the sum and the norm (2); backward reads the sum, the sum's
    # gradient and the norm's (2), writes the stream's and the branch's (2; one tensor when the stream is bf16).
    s_bytes = torch.tensor([], dtype=stream_dtype).element_size()
    bytes_bwd = (3 * s_bytes + 2 + (2 if s_bytes != 2 else 0)) * tokens * width
    return {"leaves": [x, branch, branch_bias, weight, bias], "names": ["x", "branch", "branch_bias", "weight", "bias"],
            "run": run, "upstream": upstream, "bytes_fwd": (2 * s_bytes + 4) * tokens * width, "bytes_bwd": bytes_bwd}


def modulate_case(tokens: int, width: int, device: torch.device, seed: int, rows_count: int) -> dict:
    """Inputs of the PFFN modulation: ``h`` bf16 ``[tokens, width]``, per-row ``scale``/``shift``."""
    g = torch.Generator(device=device).manual_seed(seed)
    lengths = torch.randint(1, 2 * tokens // rows_count, (rows_count,), device=device, generator=g)
    lengths = (lengths.double() * tokens / lengths.sum().double()).floor().long().clamp(min=0)
    lengths[-1] += tokens - lengths.sum()
    rows = torch.repeat_interleave(torch.arange(rows_count, device=device), lengths, output_size=tokens)
    h = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    scale = (1 + 0.1 * torch.randn(rows_count, width, device=device, generator=g)).to(torch.bfloat16).requires_grad_(True)
    shift = (0.1 * torch.randn(rows_count, width, device=device, generator=g)).to(torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16)

    def run(backend: str) -> torch.Tensor:
        return jagged_silu_modulate(h, scale, shift, rows, backend=backend)

    return {"leaves": [h, scale, shift], "names": ["h", "scale", "shift"], "run": run, "upstream": upstream,
            "bytes_fwd": 2 * tokens * width * 2, "bytes_bwd": 3 * tokens * width * 2}


def silu_split_case(tokens: int, width: int, device: torch.device, seed: int) -> dict:
    """The HSTU block's projection ``h`` bf16 ``[tokens, 4 * width]`` with its float32 bias, split into four parts
    (``u, v, q, k``), each with its own cotangent."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, 4 * width, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    bias = (0.1 * torch.randn(4 * width, device=device, generator=g)).requires_grad_(True)
    upstream = [torch.randn(tokens, width, device=device, generator=g).to(torch.bfloat16) for _ in range(4)]

    def run(backend: str) -> tuple[torch.Tensor, ...]:
        return silu_split(h, [width] * 4, bias=bias, backend=backend)

    # Backward reads the four parts' gradients and h, writes dh (2 bytes each, 4 * width columns).
    return {"leaves": [h, bias], "run": run, "upstream": upstream, "bytes_bwd": 3 * tokens * 4 * width * 2}


def launch_cases(tokens: int, width: int, device: torch.device, rows_count: int) -> dict[str, list[tuple[str, dict]]]:
    """The cases each kernel module's backward is timed on (``--launches``)."""
    residual = residual_case(tokens, width, device, seed=3, stream_dtype=torch.bfloat16)
    leaves = residual["leaves"]

    def run_residual(backend: str) -> tuple[torch.Tensor, ...]:
        x, branch, branch_bias, weight, bias = leaves
        return residual_layer_norm(x, branch, weight, bias, 1e-5, branch_bias=branch_bias, out_dtype=torch.bfloat16,
                                   backend=backend)

    up_sum, up_norm = residual["upstream"].split(width, dim=1)
    residual = dict(residual, run=run_residual, upstream=[up_sum, up_norm])
    modulate = modulate_case(tokens, width, device, seed=2, rows_count=rows_count)
    return {
        "layer_norm": [("layer_norm+silu_gate", silu_gate_norm_case(tokens, width, device, seed=1)),
                       ("residual_norm+bias", residual)],
        "silu_split": [("silu_split+bias", silu_split_case(tokens, width, device, seed=4))],
        "silu_modulate": [("silu_modulate", modulate)],
    }


@contextlib.contextmanager
def module_constants(module, values: dict):
    """``module``'s constants set to ``values`` inside the block, restored after it."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def kernel_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """Milliseconds per call of the device kernels ``fn`` launches (their sum, from the profiler): the time a CUDA
    graph of the step would spend on them, without the host's launch and autograd overhead that a wall-clock
    time of one small backward includes. On CPU, the host ops' self time (indicative only)."""
    fn()
    return profile_calls(fn, calls, torch.cuda.is_available())["kernel_ms_per_step"]


def time_backward(case: dict, repeats: int) -> tuple[float, float, list[torch.Tensor]]:
    """Median ms of the Triton backward of one recorded forward (the graph kept between runs), its device kernels'
    ms per call (:func:`kernel_ms`), and its gradients."""
    out = case["run"]("triton")
    outputs = list(out) if isinstance(out, tuple) else [out]
    upstream = case["upstream"] if isinstance(case["upstream"], list) else [case["upstream"]]

    def backward() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(outputs, case["leaves"], upstream, retain_graph=True)

    return median_ms(backward, repeats), kernel_ms(backward), list(backward())


def measure_launches(tokens: int, width: int, device: torch.device, rows_count: int, repeats: int,
                     kernels: list[str] | None = None) -> list[dict]:
    """Each backward (of ``kernels``, default all) at each of its launch shapes, with the copy rate of the device as
    the ceiling."""
    source = torch.randn(5 * tokens, width, device=device).to(torch.bfloat16)
    target = torch.empty_like(source)
    copy_ms = median_ms(lambda: target.copy_(source), repeats)
    rows = [{"kernel": "copy_", "case": "5 x [tokens, width] bf16", "shape": {}, "committed": True, "ms": copy_ms,
             "tb_per_s": 2 * source.numel() * 2 / copy_ms / 1e9 if copy_ms else None}]
    cases = launch_cases(tokens, width, device, rows_count)
    committed = {}
    for kernel, (module, shapes) in LAUNCH_SHAPES.items():
        if kernels and kernel not in kernels:
            continue
        for index, shape in enumerate(shapes):
            with module_constants(module, shape):
                for name, case in cases[kernel]:
                    ms, device_ms, grads = time_backward(case, repeats)
                    committed.setdefault(name, grads)
                    error = max(rel_error(a, b) for a, b in zip(grads, committed[name], strict=True))
                    rows.append({"kernel": kernel, "case": name, "shape": shape, "committed": index == 0, "ms": ms,
                                 "kernel_ms": device_ms,
                                 "tb_per_s": case["bytes_bwd"] / device_ms / 1e9 if device_ms else None,
                                 "rel_error_vs_committed": error})
                    print(format_launch(rows[-1]), flush=True)
    return rows


def format_launch(row: dict) -> str:
    shape = " ".join(f"{k}={v}" for k, v in row["shape"].items())
    rate = f"{row['tb_per_s']:.2f} TB/s" if row["tb_per_s"] else "-"
    mark = " (committed)" if row["committed"] and row["shape"] else ""
    error = f"{row['rel_error_vs_committed']:.1e}" if "rel_error_vs_committed" in row else ""
    kernels = f"{row['kernel_ms'] * 1e3:>10.1f} us" if "kernel_ms" in row else " " * 13
    return f"{row['case']:<22}{shape + mark:<58}{row['ms'] * 1e3:>10.1f} us {kernels} {rate:>12} {error:>9}"


def forward_backward(case: dict, backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for leaf in case["leaves"]:
        leaf.grad = None
    out = case["run"](backend)
    out.backward(case["upstream"])
    return out.detach(), [leaf.grad.clone() for leaf in case["leaves"]]


def measure(name: str, case: dict, repeats: int) -> dict:
    """Errors of the Triton backend against the reference, then both backends' median times."""
    ref_out, ref_grads = forward_backward(case, "pytorch")
    out, grads = forward_backward(case, "triton")
    errors = {"out": rel_error(out, ref_out)}
    errors.update({g: rel_error(a, b) for g, a, b in zip(case["names"], grads, ref_grads, strict=True)})
    row = {"kernel": name, "rel_error": errors}
    for backend in ("pytorch", "triton"):
        with torch.no_grad():
            fwd = median_ms(lambda b=backend: case["run"](b), repeats)
        both = median_ms(lambda b=backend: forward_backward(case, b), repeats)
        row[backend] = {"fwd_ms": fwd, "fwd_bwd_ms": both}
    tri = row["triton"]
    row["speedup_fwd_bwd"] = row["pytorch"]["fwd_bwd_ms"] / tri["fwd_bwd_ms"] if tri["fwd_bwd_ms"] else None
    row["triton_fwd_gb_per_s"] = case["bytes_fwd"] / tri["fwd_ms"] / 1e6 if tri["fwd_ms"] else None
    return row


def format_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<22}{'max rel err':>12}{'ref f+b ms':>12}{'tri f+b ms':>12}{'speedup':>9}{'tri fwd GB/s':>14}"]
    for r in rows:
        worst = max(r["rel_error"].values())
        speed = f"{r['speedup_fwd_bwd']:.2f}" if r["speedup_fwd_bwd"] else "-"
        gbs = f"{r['triton_fwd_gb_per_s']:.0f}" if r["triton_fwd_gb_per_s"] else "-"
        lines.append(
            f"{r['kernel']:<22}{worst:>12.2e}{r['pytorch']['fwd_bwd_ms']:>12.3f}{r['triton']['fwd_bwd_ms']:>12.3f}"
            f"{speed:>9}{gbs:>14}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="default: 16384 on CUDA, 96 on CPU")
    parser.add_argument("--width", type=int, default=None, help="default: 1024 on CUDA, 64 on CPU")
    parser.add_argument("--rows", type=int, default=None, help="rows of the modulation (default 32 / 4)")
    parser.add_argument("--repeats", type=int, default=5, help="host-timed repeats (CPU only)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--launches", action="store_true", help="time each backward alone at LAUNCH_SHAPES")
    parser.add_argument("--launch-kernels", nargs="+", choices=list(LAUNCH_SHAPES), default=None,
                        help="with --launches: only these kernels' backward (default all)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 to check the script on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    tokens = args.tokens or (16384 if cuda else 96)
    width = args.width or (1024 if cuda else 64)
    rows_count = args.rows or (32 if cuda else 4)
    if args.launches:
        rows = measure_launches(tokens, width, device, rows_count, args.repeats, args.launch_kernels)
        write_result(args.json, device, tokens, width, rows)
        return 0
    rows = [
        measure("layer_norm+gate", layer_norm_case(tokens, width, device, seed=1), args.repeats),
        measure("residual_norm+bias", residual_case(tokens, width, device, seed=3), args.repeats),
        measure("silu_modulate", modulate_case(tokens, width, device, seed=2, rows_count=rows_count), args.repeats),
    ]
    write_result(args.json, device, tokens, width, rows)
    print(format_table(rows))
    return 0


def write_result(path: str | None, device: torch.device, tokens: int, width: int, rows: list[dict]) -> None:
    if not path:
        return
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "tokens": tokens,
        "width": width,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
