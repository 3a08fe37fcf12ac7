"""``experiments/kernel_sass.py`` reads the tile loops out of the SASS: innermost loops holding HGMMAs, in program
order (the order the kernels call their mask-free and masked tiles), whatever their lengths; and ``--glue`` counts
how many programs of a glue kernel's backward an SM holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from experiments.kernel_sass import resident_programs, tile_loops

REPO = Path(__file__).resolve().parents[2]


def _sass(*lines: str) -> str:
    """SASS text as ``nvdisasm -c`` prints it: labels, then instructions after their ``/*offset*/``."""
    out = []
    for offset, line in enumerate(lines):
        out.append(line if line.endswith(":") else f"        /*{offset * 16:04x}*/                   {line} ;")
    return "\n".join(out)


def test_tile_loops_are_the_innermost_hgmma_loops_in_program_order():
    sass = _sass(
        ".L_x_0:",
        "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24",
        ".L_x_1:",
        "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24",
        "FMUL R1, R2, R3",
        "@P0 FMUL R1, R2, R3",
        "MUFU.EX2 R4, R5",
        "@!P1 BRA `(.L_x_1)",
        ".L_x_2:",
        "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24",
        "BRA `(.L_x_2)",
        "BRA `(.L_x_0)",
        ".L_x_3:",
        "FADD R1, R2, R3",
        "BRA `(.L_x_3)",
    )
    first, second = tile_loops(sass)
    # The first loop is longer than the second: order, not length, names them.
    assert sum(first.values()) == 5 and first["HGMMA"] == 1 and first["FMUL"] == 2 and first["MUFU"] == 1
    assert sum(second.values()) == 2 and second["HGMMA"] == 1 and second["BRA"] == 1



def test_resident_programs_follow_the_registers_the_threads_and_the_slots():
    # Session 32's optimizer kernel: 144 registers at 8 warps -> one program; 68 at 4 warps -> seven.
    assert resident_programs(144, 8) == 1
    assert resident_programs(68, 4) == 7
    assert resident_programs(217, 2) == 4  # allocated as 224 per thread
    assert resident_programs(16, 1) == 32  # program slots bind
    assert resident_programs(16, 16) == 4  # threads bind


GLUE_REPORT = """
from experiments.kernel_sass import glue_report
print("\\n".join(glue_report("silu_split", {"BLOCK_M": 16, "BLOCK_N": 128, "NUM_WARPS": 4})))
shape = {"BWD_WARPS": 4, "BWD_PROGRAMS_PER_SM": 4, "BWD_ROWS": 2, "BWD_STAGES": 2}
print("\\n".join(glue_report("layer_norm", shape)))
"""


def test_glue_report_compiles_a_backward_for_sm90_and_counts_what_an_sm_holds():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", GLUE_REPORT], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.findall(r"(\w+) +(\w+) .* regs\s+(\d+) stack\s+(\d+) smem\s+(\d+): (\d+) programs \((\d+) warps\) per SM",
                       done.stdout)
    assert [(kernel, case) for kernel, case, *_ in found] == [
        ("silu_split", "bias"), ("layer_norm", "residual"), ("layer_norm", "gated")], done.stdout
    for kernel, _, *counts in found:
        regs, _, smem, programs, warps = map(int, counts)
        assert 0 < regs <= 255 and programs == resident_programs(regs, 4) and warps == 4 * programs
        if kernel == "layer_norm":  # two stages: the next tile's rows copied into shared memory
            assert smem >= 2 * 1024 * 2 * 2, smem
