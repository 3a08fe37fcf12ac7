"""Compile a step's Triton kernels in parallel before the step runs, so its first launches find them cached.

On a machine whose Triton cache is empty, the JIT compiles each kernel at its first launch, one after another,
inside the first forward and backward. This module takes that work off the step in two parts:

1. :func:`record_launches`: while inside, every Triton launch (compiled or interpreted) is recorded instead
   of run, and its outputs stay as allocated (``torch.empty``). A training step has no host control flow
   that reads a kernel's output, so running its forward and backward this way issues exactly the launches
   of a real step. Each launch becomes a :class:`LaunchSpec`, keyed by what Triton specialises a compiled
   kernel on, computed by Triton's own argument binder: the kernel, its constexpr values, the argument types,
   the 16-byte divisibility of pointers and integers (and which integers are 1), and the launch options
   (``num_warps``, ``num_stages``, ...). Launches with equal keys are one spec. A launch that would autotune
   (no checked-in config) records every config the autotuner would compile instead
   (:func:`kernels.triton.jagged_attention._launch` asks :func:`recording`).
2. :func:`precompile`: worker processes (:class:`KernelCompilePool`) compile the specs, each through the
   JIT's own ``warmup(...)`` on the target device with stand-ins of the recorded pointers (dtype and address
   modulo 16) and the recorded scalars, so each artifact lands in the shared on-disk cache
   (``TRITON_CACHE_DIR``) under the key the real launch looks up. A worker also builds the kernel's launcher,
   which Triton 3.6 compiles with the host C compiler, per argument signature, at a kernel's first launch.
   Processes, not threads: Triton's compile runs its passes under the GIL. Each worker is a fresh
   ``python -m kernels.precompile``: never a fork of the CUDA-initialised caller, and, unlike a
   ``multiprocessing`` child, it does not re-import the caller's ``__main__`` (a whole training stack).

3. A manifest (:func:`write_manifest`, :func:`cached_step`): after a precompile that compiled every spec, the
   cache entries its workers wrote or found are listed in a small JSON file in Triton's cache directory, named by
   a key that identifies the step without recording it (:func:`step_key`: the caller's description of its model
   and batches, the source of the code that launches the kernels and of the kernels, the Triton and torch versions,
   the device capability, the kernel switches and ``TRITON_*`` variables). A later start with the same key whose
   cache still holds every file listed skips the recording and the pool: on a warm cache they cost seconds and
   find nothing to compile.

In Triton's interpreter (``TRITON_INTERPRET=1``) or without CUDA nothing is compiled: :func:`precompile` logs
one line and returns. A spec that fails to compile (in a worker, or a pool that cannot start) costs one logged
line; the JIT then compiles that kernel at its launch as it would have without this module.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import itertools
import json
import os
import pickle
import pkgutil
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAX_WORKERS = 16


@dataclass(frozen=True)
class Pointer:
    """A stand-in for a tensor argument: what Triton specialises a pointer on (its dtype, and whether its
    address is a multiple of 16, from ``data_ptr() % 16``)."""

    dtype: torch.dtype
    misalignment: int

    def data_ptr(self) -> int:
        return self.misalignment


@dataclass(frozen=True)
class LaunchSpec:
    """One kernel specialisation a step launches.

    Attributes:
        kernel: ``module:name`` of the ``@triton.jit`` function.
        key: Triton's specialisation of the launch (per parameter: ``("constexpr", value)`` or
            ``(type, attribute)``) and its options, sorted by name. Specs compare and hash by
            ``(kernel, key)``.
        args, kwargs: the first such launch's arguments, tensors as :class:`Pointer`; enough to compile it.
    """

    kernel: str
    key: tuple
    args: tuple = field(compare=False)
    kwargs: tuple = field(compare=False)

    @property
    def name(self) -> str:
        return self.kernel.rpartition(":")[2]


@dataclass
class LaunchRecord:
    """What :func:`record_launches` saw: the distinct specs in first-launch order and the launches per kernel."""

    specs: list[LaunchSpec] = field(default_factory=list)
    launches: Counter = field(default_factory=Counter)
    _seen: set = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, spec: LaunchSpec) -> bool:
        """Count a launch of ``spec``; returns whether it is the first."""
        with self._lock:
            self.launches[spec.name] += 1
            if spec in self._seen:
                return False
            self._seen.add(spec)
            self.specs.append(spec)
            return True


# The record in progress. A plain global, not a context variable: autograd runs a CUDA backward in a thread
# of its own, whose launches belong to the same record.
_ACTIVE: LaunchRecord | None = None


def recording() -> bool:
    """Whether launches are being recorded (:func:`record_launches`) instead of run."""
    return _ACTIVE is not None


@contextlib.contextmanager
def record_launches(on_spec: Callable[[LaunchSpec], object] | None = None) -> Iterator[LaunchRecord]:
    """Inside, every Triton kernel launch of the process is recorded into the yielded :class:`LaunchRecord`
    and not run (module doc); explicit ``warmup`` calls pass through. ``on_spec`` is called with each spec at its
    first launch (e.g. :meth:`CompileJob.add`: the compiles start while the recording goes on). Not re-entrant."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("record_launches is already active")
    record = LaunchRecord()

    def wrap(run: Callable) -> Callable:
        def recorded_run(kernel, *args, grid, warmup, **kwargs):
            if warmup:
                return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            spec = launch_spec(kernel, args, kwargs)
            if record.add(spec) and on_spec is not None:
                on_spec(spec)
            return None

        return recorded_run

    _ACTIVE = record
    try:
        with _wrapped_launches(wrap):
            yield record
    finally:
        _ACTIVE = None


@contextlib.contextmanager
def launches_wait_for(job: CompileJob) -> Iterator[None]:
    """Inside, a Triton launch whose spec ``job`` is compiling waits for that compile (:meth:`CompileJob.wait_for`),
    then runs, finding its kernel in the cache; other launches run at once. A first step run inside overlaps the
    compiles of the kernels it launches late (the backward's) with its own earlier work. Not re-entrant."""

    def wrap(run: Callable) -> Callable:
        def gated_run(kernel, *args, grid, warmup, **kwargs):
            if not warmup and job.pending():
                job.wait_for(launch_spec(kernel, args, kwargs))
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        return gated_run

    with _wrapped_launches(wrap):
        yield


@contextlib.contextmanager
def _wrapped_launches(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inside, the launches of compiled and interpreted Triton kernels go through ``wrap(their run)``."""
    from triton.runtime import interpreter, jit

    originals = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}
    for cls, run in originals.items():
        cls.run = wrap(run)
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


def launch_spec(kernel, args: Sequence, kwargs: dict) -> LaunchSpec:
    """The :class:`LaunchSpec` of launching ``kernel`` (a ``JITFunction`` or the interpreter's function) on
    ``args`` and ``kwargs`` (constexprs and launch options by name, as ``kernel[grid](*args, **kwargs)``)."""
    _, specialization, options = _binder(kernel)(*args, **kwargs)
    key = (tuple(tuple(s) for s in specialization), tuple(sorted(options.items())))
    return LaunchSpec(
        kernel=f"{kernel.fn.__module__}:{kernel.fn.__name__}",
        key=key,
        args=tuple(_portable(a) for a in args),
        kwargs=tuple((k, _portable(v)) for k, v in kwargs.items()),
    )


def _portable(value):
    if isinstance(value, torch.Tensor):
        return Pointer(value.dtype, value.data_ptr() % 16)
    return value


_BINDERS: dict[int, tuple[object, Callable]] = {}


def _binder(kernel) -> Callable:
    """Triton's argument binder for ``kernel``: ``(*args, **kwargs) -> (bound, specialization, options)``, the
    function a compiled kernel's launch calls to find its cache key. Built from the kernel's parameters (the
    interpreter's functions keep their ``do_not_specialize`` lists in ``kwargs``); specialisation by Triton's
    base backend, whose integer and pointer rules the CUDA backend keeps."""
    cached = _BINDERS.get(id(kernel))
    if cached is not None and cached[0] is kernel:
        return cached[1]
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    signature = inspect.signature(kernel.fn)
    params = getattr(kernel, "params", None)
    if params is None:
        options = getattr(kernel, "kwargs", {})
        plain = set(options.get("do_not_specialize") or ())
        unaligned = set(options.get("do_not_specialize_on_alignment") or ())
        params = [
            KernelParam(i, p, i in plain or p.name in plain, i in unaligned or p.name in unaligned)
            for i, p in enumerate(signature.parameters.values())
        ]
    binder = create_function_from_signature(signature, params, BaseBackend)
    _BINDERS[id(kernel)] = (kernel, binder)
    return binder


@dataclass
class PrecompileReport:
    """What :func:`precompile` did: specs compiled, failed (``kernel: error`` each) and its wall seconds; ``skipped``
    says why nothing was compiled (empty when the pool ran). ``entries``: the cache entries (directory names) the
    workers' compiles wrote or read, sorted: what the step's launches will look up (:func:`write_manifest`).
    ``slowest``: the specs that took longest, as ``(kernel, started, seconds)`` (``started``: when it was sent,
    from the start of the compile; ``seconds``: until its worker answered, a worker's late set-up included)."""

    specs: int = 0
    compiled: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 0
    skipped: str = ""
    entries: list[str] = field(default_factory=list)
    slowest: list[tuple[str, float, float]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "specs": self.specs, "compiled": self.compiled, "failed": list(self.failed), "seconds": self.seconds,
            "workers": self.workers, "skipped": self.skipped, "slowest": [list(s) for s in self.slowest],
        }


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), which compiles nothing."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


# Longer than a cold compile of every kernel a step launches, one after another.
COMPILE_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 10.0
SLOWEST_REPORTED = 3
STOP = "stop"  # what a worker reads as its last request


class KernelCompilePool:
    """Compile workers, started ahead of the specs so that their start-up (importing torch, Triton and the kernel
    modules; setting up the driver) overlaps whatever the caller does meanwhile (building the model, the first
    batch). :meth:`compile` runs specs, costliest first, each on the next free worker; :meth:`close` ends them.

    Each worker is ``python -m kernels.precompile`` (module doc: why processes, and why not forks of the caller
    or of a ``multiprocessing`` server, whose children re-import the caller's ``__main__``). It sees the caller's
    ``sys.path`` and environment (so the same ``TRITON_CACHE_DIR``), compiles for CUDA device ``device``, and
    imports ``modules`` first (every module of :mod:`kernels.triton` by default). ``processes``: workers started
    earlier (``python -m kernels.precompile --device D``, e.g. by :func:`gem.compile_workers.start_compile_workers`
    before the caller imported torch), adopted instead of starting new ones.
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        device: int = 0,
        modules: Sequence[str] | None = None,
        processes: Sequence[subprocess.Popen] | None = None,
    ) -> None:
        settle_cache_keys()
        if processes:
            self.processes = list(processes)
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            preload = ",".join(modules if modules is not None else kernel_modules())
            command = [sys.executable, "-m", __name__, "--device", str(device), "--preload", preload]
            self.processes = [
                subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                for _ in range(workers or default_workers())
            ]
        self.workers = len(self.processes)
        self.reaper: threading.Thread | None = None

    def start(self, specs: Sequence[LaunchSpec] = (), *, timeout_s: float = COMPILE_TIMEOUT_S) -> CompileJob:
        """Start compiling ``specs`` and return at once (:class:`CompileJob`: more specs can join while it runs)."""
        return CompileJob(self.processes, specs, timeout_s=timeout_s)

    def compile(self, specs: Sequence[LaunchSpec], *, timeout_s: float = COMPILE_TIMEOUT_S) -> PrecompileReport:
        """Compile ``specs`` (costliest first, see :func:`_cost`), wait for them, report; never raises
        (:meth:`CompileJob.report`)."""
        return self.start(specs, timeout_s=timeout_s).report()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S, *, wait: bool = True) -> None:
        """Stop the workers (:func:`stop_workers`); with ``wait=False`` the reaper thread is :attr:`reaper`."""
        reaper = stop_workers(self.processes, timeout_s=timeout_s, wait=wait)
        self.reaper = self.reaper or reaper

    def __enter__(self) -> KernelCompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CompileJob:
    """Specs compiling in a pool's workers (:meth:`KernelCompilePool.start`) while the caller goes on.

    :meth:`add` queues a spec; each worker, when free, takes the costliest spec waiting (:func:`_cost`), so the
    specs given at the start go longest first. :meth:`wait_for` blocks until one spec's compile is over (what a
    launch inside :func:`launches_wait_for` needs); :meth:`report` takes no more specs, waits for the rest and
    reports. The deadline, ``timeout_s`` from the start, bounds both: workers still busy at it are killed by
    :meth:`report`, a hung compile costs the first step that long at most, and the specs left fail with the
    reason (their kernels compile at their launch, as without a pool).
    """

    def __init__(self, processes: Sequence[subprocess.Popen], specs: Sequence[LaunchSpec] = (), *,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.started = time.perf_counter()
        self.timeout_s = timeout_s
        self.processes = list(processes)
        self.tasks: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()
        self.done: dict[LaunchSpec, threading.Event] = {}
        self.outcomes: list[tuple[LaunchSpec, str | None, list[str], float, float]] = []
        self.closed = False
        self.waited: Counter = Counter()  # seconds the caller waited, per kernel name (wait_for)
        self._report: PrecompileReport | None = None
        for spec in specs:
            self.add(spec)
        self.threads = [threading.Thread(target=self._serve, args=(p,), daemon=True) for p in self.processes]
        for thread in self.threads:
            thread.start()

    def add(self, spec: LaunchSpec) -> None:
        """Queue ``spec`` (ignored once :meth:`report` was called)."""
        if self.closed:
            return
        self.done.setdefault(spec, threading.Event())
        self.tasks.put((-_cost(spec), next(self.order), spec))

    def pending(self) -> bool:
        """Whether any spec added is still waiting or compiling."""
        return not all(event.is_set() for event in list(self.done.values()))

    def wait_for(self, spec: LaunchSpec) -> None:
        """Return once ``spec``'s compile is over, at once for a spec never added; also when every worker is gone or
        the deadline passed (the launch then compiles its kernel itself)."""
        event = self.done.get(spec)
        if event is None or event.is_set():
            return
        start = time.perf_counter()
        while not event.wait(0.05):
            if time.perf_counter() > self.started + self.timeout_s or not any(t.is_alive() for t in self.threads):
                break
        self.waited[spec.name] += time.perf_counter() - start

    def report(self) -> PrecompileReport:
        """Take no more specs, wait for those queued (until the deadline), report; never raises."""
        if self._report is not None:
            return self._report
        self.closed = True
        for _ in self.threads:  # each worker's thread ends on one of these, queued after every spec
            self.tasks.put((float("inf"), next(self.order), None))
        for thread in self.threads:
            thread.join(max(0.0, self.started + self.timeout_s - time.perf_counter()))
        timed_out = any(thread.is_alive() for thread in self.threads)
        if timed_out:
            for process in self.processes:
                process.kill()
            for thread in self.threads:
                thread.join()
        left = f"compile pool timed out after {self.timeout_s:g} s" if timed_out else "no compile worker left"
        while not self.tasks.empty():  # every worker died, or the pool timed out, before these
            spec = self.tasks.get()[2]
            if spec is not None:
                self.outcomes.append((spec, left, [], 0.0, 0.0))
                self.done[spec].set()
        outcomes = self.outcomes
        failed = [f"{spec.name}: {error}" for spec, error, *_ in outcomes if error is not None]
        slowest = sorted(outcomes, key=lambda outcome: outcome[4], reverse=True)[:SLOWEST_REPORTED]
        self._report = PrecompileReport(
            specs=len(outcomes), compiled=len(outcomes) - len(failed), failed=failed,
            seconds=time.perf_counter() - self.started, workers=len(self.processes),
            entries=sorted({entry for _, _, entries, *_ in outcomes for entry in entries}),
            slowest=[(spec.name, round(sent, 3), round(took, 3)) for spec, _, _, sent, took in slowest],
        )
        return self._report

    def _serve(self, process: subprocess.Popen) -> None:
        """Feed ``process`` the costliest spec waiting, one at a time, until its end marker or its death; each
        outcome is ``(spec, error, entries, sent, seconds)``, ``sent`` counted from the start."""
        while True:
            spec = self.tasks.get()[2]
            if spec is None:
                return
            sent = time.perf_counter()
            try:
                _send(process.stdin, spec)
                error, entries = _receive(process.stdout)
                self.outcomes.append((spec, error, entries, sent - self.started, time.perf_counter() - sent))
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                code = process.poll()
                died = f"compile worker died ({_one_line(err)}; exit code {code})"
                self.outcomes.append((spec, died, [], sent - self.started, time.perf_counter() - sent))
                return
            finally:
                self.done[spec].set()


def stop_workers(
    processes: Sequence[subprocess.Popen], *, timeout_s: float = CLOSE_TIMEOUT_S, wait: bool = True
) -> threading.Thread | None:
    """Stop compile workers: each is told to exit (end of input is not enough: a process forked after the workers
    started, e.g. a DataLoader worker, holds copies of the pipes' write ends), and those still running after
    ``timeout_s`` in all are killed. With ``wait=False`` the waiting and killing happen on a daemon thread, which
    is returned: a worker's interpreter (torch, Triton, a CUDA context) takes a while to tear down, and a caller
    about to run its first step need not wait for that."""
    if not processes:
        return None
    for process in processes:
        with contextlib.suppress(OSError, ValueError):
            _send(process.stdin, STOP)
        with contextlib.suppress(OSError):
            process.stdin.close()
    if wait:
        _reap(processes, timeout_s)
        return None
    reaper = threading.Thread(target=_reap, args=(list(processes), timeout_s), daemon=True)
    reaper.start()
    return reaper


def _reap(processes: Sequence[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream):
    size = stream.read(8)
    if len(size) < 8:
        raise EOFError("compile worker closed its pipe")
    return pickle.loads(stream.read(int.from_bytes(size, "little")))


def precompile(
    specs: Sequence[LaunchSpec],
    workers: int | None = None,
    *,
    pool: KernelCompilePool | None = None,
    key: str | None = None,
    log: Callable[[str], None] = print,
) -> PrecompileReport:
    """Compile ``specs`` into Triton's on-disk cache in parallel (module doc): in ``pool`` when given (left
    open), else in a pool of ``workers`` processes (default ``min(16, cpu_count)``) made and closed here. With
    ``key`` (:func:`step_key`), a pool that compiled every spec leaves the manifest of the step
    (:func:`write_manifest`), so the next start with that key can skip all this (:func:`cached_step`).

    Logs one line: what was compiled and how long it took, why nothing was (interpreter, no CUDA, no specs),
    or how many specs failed, with the first error; and one for the manifest written. Never raises for a failed
    compile.
    """
    reason = skip_reason(specs)
    if reason:
        log(f"kernel precompile: skipped ({reason})")
        return PrecompileReport(specs=len(specs), skipped=reason)
    try:
        owned = pool is None
        pool = pool or KernelCompilePool(workers, device=torch.cuda.current_device())
    except Exception as err:
        log(f"kernel precompile: no pool ({_one_line(err)}); the kernels compile at their first launch")
        return PrecompileReport(specs=len(specs), skipped=f"no pool: {_one_line(err)}")
    try:
        report = pool.compile(specs)
    finally:
        if owned:
            pool.close(wait=False)
    return conclude(report, key=key, log=log)


def conclude(report: PrecompileReport, *, key: str | None, log: Callable[[str], None]) -> PrecompileReport:
    """Log ``report``'s summary line and, with ``key`` and every spec compiled, write the step's manifest
    (:func:`write_manifest`); returns ``report``."""
    log(summary_line(report))
    if key is not None and not report.failed:
        write_manifest(key, report, log=log)
    return report


def skip_reason(specs: Sequence[LaunchSpec]) -> str:
    """Why :func:`precompile` would compile nothing here ('' when it would)."""
    if interpreted():
        return "Triton interpreter: nothing to compile"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not specs:
        return "no Triton launches recorded"
    return ""


# A directory of Triton's cache, beside its entries (directories too), holding one manifest per step key: not an
# entry of the cache (:func:`cache_entries`).
MANIFESTS = "precompile-manifests"


def cache_entries() -> frozenset[str]:
    """The entries of Triton's on-disk cache (``TRITON_CACHE_DIR``); empty in the interpreter, which compiles
    nothing, and before the cache exists."""
    if interpreted():
        return frozenset()
    from triton import knobs

    directory = knobs.cache.dir
    return frozenset(os.listdir(directory)) - {MANIFESTS} if directory and os.path.isdir(directory) else frozenset()


MANIFEST_VERSION = 1
# Files a cache entry may hold for a while that its lookups do not read.
_TRANSIENT = ("lock", "tmp.")


def step_key(identity: Sequence[str], *, device: int = 0, sources: Sequence[Path] = ()) -> str:
    """The manifest key of a step (hex sha256): the caller's ``identity`` of it (whatever decides which kernels
    its launches specialise, e.g. the model's structure, the autocast dtype, the batch shapes) and the source
    (``.py`` and ``.json`` files) under the directories ``sources`` (the code that launches the kernels), with what
    this side knows decides it too: the Triton and torch versions, CUDA device ``device``'s capability, the
    source of the ``kernels`` package (kernels, launch wrappers, tuned configs), the effective kernel switches and
    the ``TRITON_*`` environment. Computed without recording the step, so a start can decide on it before the
    model exists; any change to the source costs one precompile, which writes the manifest of the new key."""
    import triton

    from kernels.settings import effective_kernel_settings

    capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))
    parts = [
        *identity, f"triton {triton.__version__}", f"torch {torch.__version__}", f"capability {capability}",
        repr(effective_kernel_settings()), repr(environment),
    ]
    for directory in map(Path, (Path(__file__).resolve().parent, *sources)):
        for path in sorted(directory.rglob("*")):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
                # Named within the package: two checkouts of the same code share their manifests.
                parts += [f"{directory.name}/{path.relative_to(directory).as_posix()}", path.read_text()]
    digest = hashlib.sha256()
    for part in parts:  # length-prefixed: parts cannot run into one another
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def manifest_path(key: str) -> Path | None:
    """Where the manifest of step ``key`` lives in Triton's cache (None in the interpreter or without a cache
    directory: nothing is compiled, or kept, there)."""
    if interpreted():
        return None
    from triton import knobs

    directory = knobs.cache.dir
    return Path(directory) / MANIFESTS / f"{key}.json" if directory else None


def write_manifest(key: str, report: PrecompileReport, *, log: Callable[[str], None] = print) -> Path | None:
    """Record that the step ``key`` needs the cache entries ``report.entries`` (:meth:`KernelCompilePool.compile`),
    with the files each holds now; returns the manifest's path, or None where none is written (entries unknown,
    or the cache unwritable: one logged line). Written whole or not at all (a temporary file, then renamed), so
    a concurrent reader or a crash never leaves a partial manifest under the key's name."""
    path = manifest_path(key)
    if path is None or not report.entries:
        return None
    cache = path.parent.parent
    entries = {}
    for entry in report.entries:
        with contextlib.suppress(OSError):
            files = sorted(f for f in os.listdir(cache / entry) if not f.startswith(_TRANSIENT))
            if files:
                entries[entry] = files
    manifest = {"version": MANIFEST_VERSION, "key": key, "specs": report.specs, "entries": entries}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        log(f"kernel precompile: no manifest written ({_one_line(err)})")
        return None
    log(f"kernel precompile: manifest {path} ({len(entries)} cache entries)")
    return path


def cached_step(key: str, *, log: Callable[[str], None] = print) -> str:
    """Why the step ``key`` needs no precompile: its manifest (:func:`write_manifest`) parses and every file it
    lists is in the cache (then ``"cache holds the N kernels of this step, manifest <file>"``); '' otherwise.
    Logs one line for a manifest that does not parse or lists files that are gone; no manifest, no line. Never
    raises.

    Before it says so, it settles the process's kernel keys (:func:`settle_cache_keys`), as a pool's start does:
    the files listed are an earlier pool's, under its workers' keys, and a caller that skips the pool on this
    answer starts none to settle them. Unsettled, on Triton 3.6, the step's launches looked the attention kernels
    up under other keys and compiled them again. Call it before the step's first launch."""
    path = manifest_path(key)
    try:
        if path is None or not path.is_file():
            return ""
        specs, entries = _read_manifest(path, key)
        cache = path.parent.parent
        missing = sum(not (cache / entry / name).is_file() for entry, files in entries.items() for name in files)
    except (OSError, ValueError) as err:
        log(f"kernel precompile: manifest {path} ignored ({_one_line(err)})")
        return ""
    if missing:
        log(f"kernel precompile: manifest {path} lists {missing} cache files that are gone; compiling")
        return ""
    try:
        settle_cache_keys()
    except Exception as err:  # a pool could not start either (it settles too): those that miss compile at launch
        log(f"kernel precompile: kernel cache keys not settled ({_one_line(err)})")
    return f"cache holds the {specs} kernels of this step, manifest {path}"


def _read_manifest(path: Path, key: str) -> tuple[int, dict[str, list[str]]]:
    """``(specs, entries)`` of the manifest at ``path``; ValueError unless it is one of ``key``."""
    try:
        manifest = json.loads(path.read_bytes())
    except UnicodeDecodeError as err:  # a ValueError whose message is the offending bytes
        raise ValueError("not UTF-8 text") from err
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION or manifest.get("key") != key:
        raise ValueError(f"not a version {MANIFEST_VERSION} manifest of this key")
    specs, entries = manifest.get("specs"), manifest.get("entries")
    if not (isinstance(specs, int) and isinstance(entries, dict) and entries and all(
        isinstance(files, list) and files and all(isinstance(f, str) for f in files) for files in entries.values()
    )):
        raise ValueError("no spec count or cache entries")
    return specs, entries


def compiled_since(before: frozenset[str]) -> list[str]:
    """The kernels compiled into Triton's cache since it held the entries ``before`` (:func:`cache_entries`), by
    name, sorted: a kernel's entry holds its group file ``__grp__<name>.json`` (a launcher's or an autotuning
    result's holds none)."""
    from triton import knobs

    names = []
    for entry in sorted(cache_entries() - before):
        with contextlib.suppress(OSError):
            names += [f[len("__grp__"):-len(".json")] for f in os.listdir(os.path.join(knobs.cache.dir, entry))
                      if f.startswith("__grp__") and f.endswith(".json")]
    return sorted(names)


def compiled_line(what: str, names: Sequence[str]) -> str:
    """One log line: how many kernels ``what`` compiled itself (the precompile's misses) and which."""
    counts = Counter(names)
    listed = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(counts.items()))
    return f"{what}: {len(names)} Triton kernels compiled in-process (cache misses){': ' + listed if names else ''}"


def summary_line(report: PrecompileReport) -> str:
    line = f"kernel precompile: {report.compiled}/{report.specs} specs in {report.seconds:.1f} s on {report.workers} workers"
    if report.failed:
        line += (f"; {len(report.failed)} failed, first {report.failed[0]}"
                 "; those compile at their first launch")
    return line


def kernel_modules() -> list[str]:
    """The modules of :mod:`kernels.triton` (what a compile worker imports kernels from)."""
    import kernels.triton as package

    return [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def settle_cache_keys(modules: Sequence[str] | None = None) -> int:
    """Give the ``@triton.jit`` functions of ``modules`` (default :func:`kernel_modules`) the cache keys that every
    process computes for them, whatever it compiled before; returns how many. Both sides of a precompile call
    it (the caller when its pool starts, or when a manifest says an earlier pool's artifacts are there:
    :func:`cached_step`; each worker after its imports), so a worker's artifact lands under the key the caller's
    launch looks up.

    Why: a kernel's key hashes the ``constexpr`` globals that it and the functions it calls read. Triton 3.6 merges
    a called function's globals into its caller's before it hashes that function, so a caller hashed before its
    callees misses their globals: its key depends on which kernels the process hashed first (the backward's,
    whose helpers the forward hashed, differ between a worker and the training process). Triton 3.9 hashes the
    callee first; so does this, for any version: it wraps the hash step to do that, then rehashes the modules'
    functions. Nothing to do in the interpreter, which compiles nothing.
    """
    if interpreted():
        return 0
    from triton.runtime.jit import DependenciesFinder, JITFunction

    update_hash = getattr(DependenciesFinder, "_update_hash", None)
    if update_hash is None:  # another Triton's internals: keys stay as it computes them (misses compile at launch)
        return 0
    if not getattr(update_hash, "callee_first", False):

        def callee_first(finder, func):
            func.cache_key  # noqa: B018  (computes the callee's key and its globals before they are merged)
            update_hash(finder, func)

        callee_first.callee_first = True
        DependenciesFinder._update_hash = callee_first
    functions = {
        id(value): value
        for module in (modules if modules is not None else kernel_modules())
        for value in vars(importlib.import_module(module)).values()
        if isinstance(value, JITFunction)
    }
    for function in functions.values():
        function.hash = None
    for function in functions.values():
        function.cache_key  # noqa: B018
    return len(functions)


def _cost(spec: LaunchSpec) -> int:
    """A deterministic guess of a spec's compile time, for longest-first scheduling: its kernel's source length."""
    try:
        return len(inspect.getsource(_resolve(spec.kernel).fn))
    except (OSError, TypeError, ImportError, LookupError):
        return 0


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _resolve(kernel: str):
    module, _, name = kernel.partition(":")
    found = getattr(importlib.import_module(module), name, None)
    if found is None or not hasattr(found, "warmup"):
        raise LookupError(f"{kernel} is not a Triton kernel")
    return found


def _compile_spec(spec: LaunchSpec) -> list[str]:
    """In a worker: compile ``spec`` into the on-disk cache through the kernel's ``warmup``, and build its launcher;
    returns the cache entries that took (:func:`_entries_used`)."""
    from triton.runtime import driver

    with _entries_used() as used:
        compiled = _resolve(spec.kernel).warmup(*spec.args, grid=(1,), **dict(spec.kwargs))
        launcher = getattr(driver.active, "launcher_cls", None)
        if compiled is not None and launcher is not None:
            launcher(compiled.src, compiled.metadata)
    return sorted(used)


@contextlib.contextmanager
def _entries_used() -> Iterator[set[str]]:
    """Inside, the entries of Triton's on-disk cache that a compile or a launcher build opens (to read or to write)
    are collected into the yielded set. Triton opens an entry through a ``FileCacheManager`` made for it, whether it
    finds the entry or fills it; a custom cache manager (``TRITON_CACHE_MANAGER``) opens none that this sees, and the
    set stays empty (then no manifest is written)."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    used: set[str] = set()
    init = FileCacheManager.__init__
    cache = os.path.normpath(knobs.cache.dir or "")

    def recording_init(manager, key, *args, **kwargs):
        init(manager, key, *args, **kwargs)
        # Only entries of the cache the launches read: the dump and override managers' directories are elsewhere.
        if os.path.normpath(os.path.dirname(getattr(manager, "cache_dir", None) or "")) == cache:
            used.add(key)

    FileCacheManager.__init__ = recording_init
    try:
        yield used
    finally:
        FileCacheManager.__init__ = init


def _worker(device: int, preload: list[str]) -> None:
    """A compile worker: set up, then compile each spec read from stdin, answering ``(None, entries)`` (the cache
    entries the compile used) or ``(the error's line, [])``.

    The answers go to the original stdout; everything else that writes to file descriptor 1 (Triton's tools,
    stray prints) goes to stderr instead, so it cannot corrupt them.
    """
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    try:
        _set_up_worker(device, preload)
        broken = None
    except Exception as err:  # every spec is answered with it: the caller logs one line
        broken = f"worker set-up: {_one_line(err)}"
    while True:
        try:
            spec = _receive(requests)
        except EOFError:
            return
        if spec == STOP:
            return
        error, entries = broken, []
        if error is None:
            try:
                entries = _compile_spec(spec)
            except Exception as err:
                error = _one_line(err)
        _send(answers, (error, entries))


def _set_up_worker(device: int, preload: list[str]) -> None:
    for module in preload:
        importlib.import_module(module)
    settle_cache_keys(preload)
    from triton.runtime import driver

    if device:  # a context on device 0 would cost memory and time for nothing: a compile needs none
        torch.cuda.set_device(device)
    # The driver's first use builds its helper module (cached): done here, while the caller is still busy.
    driver.active.get_current_target()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a kernel compile worker (KernelCompilePool starts these)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--preload", default=None, help="modules to import, comma-separated (default: every kernel module)")
    options = parser.parse_args()
    preload = kernel_modules() if options.preload is None else [m for m in options.preload.split(",") if m]
    _worker(options.device, preload)
