"""Headless-Chromium screenshots of the MLflow UI as a user opens it after ``gem quickstart``.

Serves the tracking store with ``mlflow server`` on a free loopback port, then drives headless Chromium
(Debian's ``chromium``) over its DevTools protocol (``aiohttp``, an MLflow dependency, as the client) to
render the experiment page (the quickstart parent run with its stages nested under it) and a training run's
page (its metrics and artifacts: checkpoint, loss plot), each once its data has loaded, and saves PNGs::

    python -m experiments.mlflow_screenshot --db mlflow.db --out docs/images

The run shown is the quickstart's GEM teacher (``--run`` picks another by run id).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import mlflow

CHROMIUM = "chromium"
# MLflow 3's UI keeps these in localStorage (key `<name>_v<version>`): the "Model training" workflow instead of
# GenAI, and its assistant panel neither open nor opened on first load.
UI_SETTINGS = """
localStorage.setItem("mlflow.workflowType_v1", JSON.stringify("machine_learning"));
localStorage.setItem("mlflow.assistant.panelOpen_v1", "false");
localStorage.setItem("mlflow.assistant.fab.autoOpenedOnFirstLoad_v1", "true");
"""
# Expand the quickstart's parent row in the runs table, so its stages show nested under it.
EXPAND_PARENT = """
[...document.querySelectorAll('.ag-row')].filter(r => r.innerText.includes('quickstart ('))
  .forEach(r => r.querySelector('button')?.click());
"""
WINDOW = "1600,1000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer {url} in {timeout} s")


@contextmanager
def background(command: list[str], health_url: str, name: str) -> Iterator[None]:
    """``command`` running in the background until the context exits, once ``health_url`` answers."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_http(health_url, proc, name)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def serve(db: Path) -> Iterator[int]:
    """``mlflow server`` on ``db`` on a free loopback port (yields the port once it is healthy)."""
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db.resolve()}",
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with background(command, f"http://127.0.0.1:{port}/health", "mlflow server"):
        yield port


@contextmanager
def chromium() -> Iterator[int]:
    """Headless Chromium with the DevTools protocol on a free port (yields the port)."""
    port = free_port()
    command = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--window-size={WINDOW}", f"--remote-debugging-port={port}", "about:blank"]
    with background(command, f"http://127.0.0.1:{port}/json/version", "chromium"):
        yield port


async def capture(
    devtools_port: int, url: str, wait_for: str, path: Path, *, then: str = "", timeout: float = 90
) -> None:
    """Open ``url`` in the browser's page, wait until its text contains ``wait_for`` (the page has loaded
    its data, not just its skeleton), run the script ``then`` (e.g. a click), let it settle, and save a PNG
    of the window."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{devtools_port}/json/list") as response:
            page = next(t for t in await response.json() if t["type"] == "page")
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1 << 30))

            async def call(method: str, **params):
                message_id = next(ids)
                await ws.send_json({"id": message_id, "method": method, "params": params})
                async for message in ws:
                    reply = message.json()
                    if reply.get("id") == message_id:
                        if "error" in reply:
                            raise RuntimeError(f"{method}: {reply['error']}")
                        return reply["result"]
                raise RuntimeError("the browser closed the connection")

            async def load() -> None:
                deadline = time.monotonic() + timeout
                while True:
                    text = await call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''")
                    if wait_for in text["result"].get("value", ""):
                        return
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url}: {wait_for!r} did not appear in {timeout} s")
                    await asyncio.sleep(1)

            await call("Page.navigate", url=url)
            await load()
            # The UI's own switches, as a user leaves them (the training-runs view, the assistant panel closed),
            # then the page again under them.
            await call("Runtime.evaluate", expression=UI_SETTINGS)
            await call("Page.reload")
            await asyncio.sleep(1)
            await load()
            if then:
                await call("Runtime.evaluate", expression=then)
            await asyncio.sleep(3)
            shot = await call("Page.captureScreenshot", format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


def pick_run(db: Path, run_id: str | None) -> tuple[str, str, str]:
    """``(experiment id, run id, run name)``: ``run_id``'s, or the quickstart's GEM teacher run."""
    client = mlflow.MlflowClient(f"sqlite:///{db.resolve()}")
    if run_id:
        run = client.get_run(run_id)
    else:
        experiment = client.get_experiment_by_name("gem")
        (run,) = client.search_runs(
            [experiment.experiment_id], filter_string="attributes.run_name LIKE 'teacher: GEM teacher%'", max_results=1
        )
    return run.info.experiment_id, run.info.run_id, run.info.run_name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="mlflow.db", help="the sqlite tracking store")
    parser.add_argument("--out", default="docs/images", help="directory for the PNGs")
    parser.add_argument("--run", help="run id of the training run to show (default: the quickstart's teacher)")
    args = parser.parse_args(argv)
    experiment_id, run_id, run_name = pick_run(Path(args.db), args.run)
    with serve(Path(args.db)) as port, chromium() as devtools:
        base = f"http://127.0.0.1:{port}/#/experiments/{experiment_id}"
        shots = [
            ("mlflow-experiment.png", f"{base}/runs", "quickstart (", EXPAND_PARENT),
            ("mlflow-training-run.png", f"{base}/runs/{run_id}", "train/loss", ""),
            ("mlflow-training-plot.png", f"{base}/runs/{run_id}/artifacts/plots/training.png", "training.png", ""),
        ]
        for name, url, wait_for, then in shots:
            asyncio.run(capture(devtools, url, wait_for, Path(args.out) / name, then=then))
            print(f"{url} ({run_name if 'runs/' in url else 'runs'}) -> {Path(args.out) / name}")


if __name__ == "__main__":
    main()
