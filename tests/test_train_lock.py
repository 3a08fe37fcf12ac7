"""The run lock of ``gem train``: refused while its trainer lives, free once the trainer dies, even while processes
it forked (data-loader workers) live on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gem.run_dir import RunConflict, train_lock

# Takes the lock, forks a child that outlives it (as a data-loader worker does), says so, then waits to be killed.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from gem.run_dir import train_lock
    with train_lock(Path(sys.argv[1])):
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
    """
)


def test_the_lock_refuses_a_second_trainer_and_ends_with_a_killed_one_not_with_its_children(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(RunConflict, match="being trained by another process"), train_lock(run_dir):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        os.kill(child, 0)  # the forked child is still alive
        deadline = time.monotonic() + 10
        while True:
            try:
                with train_lock(run_dir):
                    break
            except RunConflict:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        os.kill(child, 0)  # ... and the lock was free while it lived
    finally:
        holder.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
