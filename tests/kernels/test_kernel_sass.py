"""``experiments/kernel_sass.py`` reads the tile loops out of the SASS: innermost loops holding HGMMAs, in program
order (the order the kernels call their mask-free and masked tiles), whatever their lengths."""

from __future__ import annotations

from experiments.kernel_sass import tile_loops


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

