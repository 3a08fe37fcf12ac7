"""How long each command of the README's walkthrough takes, run as written, in order, in a fresh directory.

Usage::

    python -m experiments.readme_times --work /tmp/readme-times --sequences ../shared/data/ml-1m/sequences.tsv \\
        --json docs/results/readme_times_cpu.json
    python -m experiments.readme_times ... --extra 'gem train --flavor ml1m_hstu=train.max_epochs=1'
    python -m experiments.readme_times --combine part1.json part2.json --json docs/results/readme_times_gpu.json

The commands are read from the README (the ```bash block after the ``readme-chain`` marker, the block that
``tests/test_readme_chain.py`` runs at tiny sizes), so what is timed is what a reader types. Each runs through
``bash`` in ``--work`` with ``gem`` on the PATH as in an activated virtual environment, tracking to
``--work/mlflow.db``. Two things differ from a reader's machine, and each row says so in its ``note``:

- the MovieLens download is replaced by a ``ratings.dat`` of the same size and format written from
  ``--sequences`` (all 1,000,209 ratings of ML-1M in their order, one timestamp per position), because these
  machines reach no web site;
- ``--extra PREFIX=ARGS`` appends arguments to the commands that start with ``PREFIX`` (e.g. one epoch of a
  100-epoch flavor, whose full time is then that epoch's times the flavor's epochs), and ``--skip PREFIX=REASON``
  leaves out commands the machine cannot run as written (two GPU processes on a one-GPU machine).

``--start N --reuse`` goes on from the N-th command in a ``--work`` where an earlier invocation ran the ones
before (a chain longer than one call of a lent GPU machine); the rows of those, and of later ones it skips but the earlier call ran, are kept from ``--json``. A background command (``... &``) is timed until its server answers ``/ping`` and stopped at the end. A command
that fails or passes ``--timeout`` is recorded with its exit status and the chain goes on (later commands may
then fail for want of its output: the rows say which). Reported per command: wall seconds, CPU seconds of the
processes it ran (user + system, from ``getrusage`` of the children: less sensitive to other load on the
machine than wall time), exit status; written atomically to ``--json`` with the machine, date and torch build.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from foundation.data.converters import open_input
from foundation.data.io import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-chain"
DOWNLOAD = "curl -sLO https://files.grouplens.org"
ML1M_FIRST_TIMESTAMP = 956703932


def readme_commands(readme: Path = REPO / "README.md") -> list[str]:
    """The walkthrough's commands, comments stripped, in order."""
    block = re.search(re.escape(MARKER) + r".*?```bash\n(.*?)```", readme.read_text(), re.S)
    if block is None:
        raise SystemExit(f"{readme}: no ```bash block after {MARKER!r}")
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def gem_environment(work: Path, extra_path: tuple[str, ...] = ()) -> dict[str, str]:
    """``gem`` as a console script on the PATH (this interpreter's tools behind it), tracking to
    ``work/mlflow.db``: what ``. .venv/bin/activate`` gives a reader."""
    shims = work / ".bin"
    shims.mkdir(parents=True, exist_ok=True)
    gem = shims / "gem"
    gem.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gem.cli "$@"\n')
    gem.chmod(0o755)
    path = [str(shims), *extra_path, str(Path(sys.executable).parent), os.environ["PATH"]]
    return {
        **os.environ,
        "PATH": os.pathsep.join(path),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db",
    }


def apply_export(command: str, env: dict[str, str]) -> bool:
    """Whether ``command`` is an ``export NAME=VALUE ...`` line; if so, its variables are set in ``env``, as
    in the reader's shell, for the commands after it."""
    if not command.startswith("export "):
        return False
    for assignment in shlex.split(command)[1:]:
        name, sep, value = assignment.partition("=")
        if not sep:
            raise SystemExit(f"README: {command!r}: expected NAME=VALUE after export")
        env[name] = value
    return True


def write_ratings_from_sequences(sequences: Path, out: Path) -> int:
    """``out`` as ML-1M's ``UserID::MovieID::Rating::Timestamp`` lines, one per movie of ``sequences``
    (``user<TAB>movies oldest first``, gzip or not), timestamps increasing by one second per event. Returns
    the lines."""
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open_input(sequences) as src, out.open("w") as dst:
        for raw in src:
            user, _, movies = raw.decode().rstrip("\n").partition("\t")
            for movie in movies.split():
                dst.write(f"{user}::{movie}::4::{ML1M_FIRST_TIMESTAMP + count}\n")
                count += 1
    return count


@dataclass
class Timing:
    number: int
    command: str
    wall_s: float | None
    cpu_s: float | None
    rc: int
    note: str = ""


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_ping(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def parse_pairs(pairs: list[str], option: str) -> dict[str, str]:
    """``["PREFIX=VALUE", ...]`` as ``{PREFIX: VALUE}``."""
    parsed = {}
    for pair in pairs:
        prefix, sep, value = pair.partition("=")
        if not sep or not prefix.strip():
            raise SystemExit(f"{option} {pair!r}: expected 'COMMAND PREFIX=...'")
        parsed[prefix.strip()] = value
    return parsed


def with_extra(command: str, extra: dict[str, str]) -> tuple[str, str]:
    """The command with the arguments of the longest matching ``--extra`` prefix appended, and the note."""
    matches = [prefix for prefix in extra if command.startswith(prefix)]
    if not matches:
        return command, ""
    args = extra[max(matches, key=len)]
    background = command.endswith("&")
    base = command.rstrip("&").strip()
    return f"{base} {args}{' &' if background else ''}", f"run with {args!r} appended"


def run_background(
    command: str, work: Path, env: dict[str, str], timeout: float, log
) -> tuple[Timing, subprocess.Popen]:
    port = re.search(r"-p (\d+)", command)
    if port is None:
        raise SystemExit(f"background command without '-p PORT' to wait for: {command}")
    start = time.perf_counter()
    proc = subprocess.Popen(command.rstrip("&").strip(), shell=True, cwd=work, env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    ready = wait_for_ping(int(port.group(1)), proc, timeout)
    wall = time.perf_counter() - start
    if ready:
        note = "until /ping answers"
    elif proc.poll() is not None:
        note = f"exited with status {proc.returncode} before answering /ping"
    else:
        note = f"no /ping answer within {timeout:.0f} s"
    return Timing(0, command, round(wall, 2), None, 0 if ready else 1, note), proc


def run_one(command: str, work: Path, env: dict[str, str], timeout: float, log) -> Timing:
    cpu0, start = children_cpu_s(), time.perf_counter()
    try:
        done = subprocess.run(command, shell=True, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout, start_new_session=True)
        rc, note = done.returncode, ""
    except subprocess.TimeoutExpired:
        rc, note = 124, f"stopped at --timeout {timeout:.0f} s"
    return Timing(0, command, round(time.perf_counter() - start, 2), round(children_cpu_s() - cpu0, 2), rc, note)


def time_chain(args: argparse.Namespace) -> list[Timing]:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=args.reuse)
    env = gem_environment(work, tuple(args.path))
    extra = parse_pairs(args.extra, "--extra")
    skips = parse_pairs(args.skip, "--skip")
    rows: list[Timing] = []
    server = None
    started = time.perf_counter()
    with (work / "chain.log").open("a" if args.reuse else "w") as log:
        try:
            for number, command in enumerate(readme_commands(args.readme), start=1):
                if apply_export(command, env) or number < args.start:
                    continue
                left = args.budget - (time.perf_counter() - started)
                skip = [reason for prefix, reason in skips.items() if command.startswith(prefix)]
                if args.only and number not in args.only:
                    skip.append("not in --only")
                if skip:
                    rows.append(Timing(number, command, None, None, -1, f"not run: {skip[0]}"))
                    continue
                if left <= 0:
                    rows.append(Timing(number, command, None, None, -1, "not run: --budget spent"))
                    continue
                if command.startswith(DOWNLOAD):
                    start = time.perf_counter()
                    lines = write_ratings_from_sequences(args.sequences, work / "ml-1m" / "ratings.dat")
                    rows.append(Timing(number, command, round(time.perf_counter() - start, 2), 0.0, 0,
                                       f"replaced: {lines:,} ratings written from {args.sequences.name}"))
                    continue
                full, note = with_extra(command, extra)
                log.write(f"\n$ {full}\n")
                log.flush()
                if full.endswith("&"):
                    row, server = run_background(full, work, env, min(args.timeout, left), log)
                else:
                    row = run_one(full, work, env, min(args.timeout, left), log)
                row.number, row.command = number, command
                row.note = "; ".join(n for n in (note, row.note) if n)
                rows.append(row)
                print(f"{number:3d} {seconds(row.wall_s)} s wall {seconds(row.cpu_s)} s cpu rc={row.rc}  {command[:90]}", flush=True)
        finally:
            if server is not None:
                stop(server)
    return rows


def stop(server: subprocess.Popen) -> None:
    """Stop a background command's process group, which may have exited already."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    server.wait(timeout=30)


def prefer(kept: Timing | None, row: Timing) -> Timing:
    """Of two rows of one command, the one that ran, and of two that ran the one that succeeded; else ``row``."""
    if kept is None:
        return row
    rank = lambda t: (t.rc != -1, t.rc == 0)  # noqa: E731
    return kept if rank(kept) > rank(row) else row


def merge_earlier(path: Path | None, start: int, rows: list[Timing]) -> list[Timing]:
    """With ``--start N``, ``rows`` completed by the ``--json`` an earlier call wrote: its rows of the commands
    before N, and of any later command this call did not run (``--skip``) but the earlier one did."""
    if start <= 1 or path is None or not path.is_file():
        return rows
    earlier = {row["number"]: Timing(**row) for row in json.loads(path.read_text())["rows"]}
    merged = {number: row for number, row in earlier.items() if number < start}
    for row in rows:
        merged[row.number] = prefer(earlier.get(row.number), row)
    return [merged[number] for number in sorted(merged)]


def combine(paths: list[Path], out: Path) -> dict:
    """One report from several (calls of one machine that each ran part of the chain): per command the row that
    ran and succeeded, the later file winning ties; each row's note names its file."""
    reports = [json.loads(path.read_text()) for path in paths]
    merged: dict[int, Timing] = {}
    for path, report in zip(paths, reports, strict=True):
        for row in map(lambda r: Timing(**r), report["rows"]):
            if row.rc != -1:
                row.note = "; ".join(n for n in (row.note, f"from {path.name}") if n)
            merged[row.number] = prefer(merged.get(row.number), row)
    rows = [merged[number] for number in sorted(merged)]
    combined = {
        **reports[-1],
        "command": [report["command"] for report in reports],
        "total_wall_s": round(sum(r.wall_s for r in rows if r.wall_s is not None and r.rc == 0), 1),
        "rows": [asdict(r) for r in rows],
    }
    atomic_write_text(out, json.dumps(combined, indent=2) + "\n")
    return combined


def machine() -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["description"] = f"{info.get('gpu', 'no GPU')}, {info['cpus']} CPU cores"
    return info


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(rows: list[Timing]) -> str:
    lines = ["| command | wall s | CPU s | rc | note |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| `{r.command[:70]}` | {seconds(r.wall_s)} | {seconds(r.cpu_s)} | {r.rc} | {r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, help="fresh directory the chain runs in")
    p.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                   help="instead of running: merge these reports (parts of one chain) into --json")
    p.add_argument("--reuse", action="store_true", help="allow --work to exist (reruns resume finished stages)")
    p.add_argument("--start", type=int, default=1,
                   help="number (from 1, export lines counted) of the first command to run; with --reuse, to go on "
                        "in a --work where an earlier call ran the ones before")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
    p.add_argument("--sequences", type=Path, default=REPO.parent / "shared/data/ml-1m/sequences.tsv",
                   help="ML-1M sequences.tsv the download is replaced by")
    p.add_argument("--extra", action="append", default=[], metavar="PREFIX=ARGS")
    p.add_argument("--skip", action="append", default=[], metavar="PREFIX=REASON",
                   help="commands starting with PREFIX are not run; the row says REASON")
    p.add_argument("--only", type=lambda text: {int(n) for n in text.split(",")}, default=set(),
                   help="comma-separated command numbers to run (the rest are rows marked not run)")
    p.add_argument("--path", action="append", default=[], help="directory put on the PATH (e.g. where mlflow is)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one command may take")
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds for the whole chain")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.combine:
        if args.json is None:
            p.error("--combine needs --json")
        print(markdown([Timing(**row) for row in combine(args.combine, args.json)["rows"]]))
        return 0
    if args.work is None:
        p.error("--work is required")
    if not args.sequences.is_file():
        raise SystemExit(f"--sequences {args.sequences}: no such file (ML-1M's sequences.tsv)")
    rows = merge_earlier(args.json, args.start, time_chain(args))
    print(markdown(rows))
    if args.json:
        report = {
            "machine": machine(),
            "date": datetime.date.today().isoformat(),
            "command": shlex.join([sys.executable, "-m", "experiments.readme_times", *(argv or sys.argv[1:])]),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "total_wall_s": round(sum(r.wall_s for r in rows if r.wall_s is not None), 1),
            "rows": [asdict(r) for r in rows],
        }
        atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
    return 0 if all(r.rc == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
