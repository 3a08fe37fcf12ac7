"""The precompile's manifest (:func:`kernels.precompile.step_key`, :func:`~kernels.precompile.write_manifest`,
:func:`~kernels.precompile.cached_step`) and the skip it allows at the sites that record the step and start the pool.

Outside Triton's interpreter (the manifest lives in the cache the compiled kernels do) with a cache directory of
the test's own; no CUDA needed: the decision is the manifest against the files in the cache.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gem.precompile
import kernels.precompile
import kernels.triton
from gem.precompile import module_identity, precompile_step, step_key, warm_cache
from kernels.precompile import (
    MANIFESTS,
    PrecompileReport,
    cache_entries,
    cached_step,
    manifest_path,
    precompile,
    write_manifest,
)
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config

ENTRIES = {"AAAA": ["__grp__k.json", "k.cubin", "k.json"], "BBBB": ["__grp__g.json", "g.cubin", "g.json"]}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A Triton cache of the test's own, holding the entries ``ENTRIES``, read as by a process that compiles."""
    # Triton decides at a kernel's definition whether it interprets it: defined while the variable is unset, a
    # kernel would try to compile in every later test of the run.
    for module in pkgutil.iter_modules(kernels.triton.__path__, "kernels.triton."):
        importlib.import_module(module.name)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    directory = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(directory))
    for entry, files in ENTRIES.items():
        (directory / entry).mkdir(parents=True)
        for name in files:
            (directory / entry / name).write_text("{}")
    return directory


def write(key: str, lines: list[str]) -> Path:
    path = write_manifest(key, PrecompileReport(specs=2, compiled=2, entries=sorted(ENTRIES)), log=lines.append)
    assert path is not None
    return path


def model():
    from foundation.model.teacher import build_teacher

    torch.manual_seed(0)
    return build_teacher(tiny_config(generative=True), CTR_SCHEMA)


def test_the_key_is_stable_and_changes_with_what_decides_the_kernels(tmp_path, monkeypatch):
    """Same inputs, same key (from another checkout too); another model, config, autocast dtype, kernel switch,
    Triton setting, kernel source or model source: another key."""
    cpu = torch.device("cpu")
    identity = [module_identity(model())]
    key = step_key(identity, autocast_dtype=torch.bfloat16, device=cpu)
    assert key == step_key([module_identity(model())], autocast_dtype=torch.bfloat16, device=cpu)
    assert len(key) == 64 and int(key, 16) >= 0

    from foundation.model.teacher import build_teacher

    wider = build_teacher(tiny_config(generative=True).replace(d_model=48), CTR_SCHEMA)
    others = {
        "model": step_key([module_identity(wider)], autocast_dtype=torch.bfloat16, device=cpu),
        "config": step_key([repr(tiny_config(generative=False))], autocast_dtype=torch.bfloat16, device=cpu),
        "dtype": step_key(identity, autocast_dtype=None, device=cpu),
    }
    for name, variable, value in [("switch", "GEM_ATTENTION_BACKEND", "pytorch"),
                                  ("triton setting", "TRITON_DEFAULT_FP_FUSION", "changed")]:
        with monkeypatch.context() as patch:
            patch.setenv(variable, value)
            others[name] = step_key(identity, autocast_dtype=torch.bfloat16, device=cpu)

    # The kernels and the models, read from copies (elsewhere: the same key) whose one file gains a line.
    import foundation

    for name, module, changed in [("kernel source", kernels.precompile, "triton/layer_norm.py"),
                                  ("model source", foundation, "model/teacher.py")]:
        package = tmp_path / name / Path(module.__file__).parent.name
        shutil.copytree(Path(module.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
        with monkeypatch.context() as patch:
            patch.setattr(module, "__file__", str(package / Path(module.__file__).name))
            assert step_key(identity, autocast_dtype=torch.bfloat16, device=cpu) == key
            with (package / changed).open("a") as f:
                f.write("# changed\n")
            others[name] = step_key(identity, autocast_dtype=torch.bfloat16, device=cpu)

    assert key not in others.values() and len(set(others.values())) == len(others), others


def test_a_manifest_whose_entries_are_present_skips(cache):
    lines: list[str] = []
    path = write("k1", lines)
    assert path == cache / MANIFESTS / "k1.json" and path == manifest_path("k1")
    assert lines == [f"kernel precompile: manifest {path} (2 cache entries)"]
    assert cached_step("k1", log=lines.append) == f"cache holds the 2 kernels of this step, manifest {path}"
    assert len(lines) == 1
    assert cached_step("k2", log=lines.append) == "" and len(lines) == 1  # no manifest for that key: no line
    assert MANIFESTS not in cache_entries() and cache_entries() == set(ENTRIES)


@pytest.mark.parametrize("gone", ["file", "entry"])
def test_a_manifest_with_an_entry_gone_does_not_skip(cache, gone):
    lines: list[str] = []
    path = write("k1", lines)
    if gone == "file":
        (cache / "BBBB" / "g.cubin").unlink()
    else:
        shutil.rmtree(cache / "AAAA")
    assert cached_step("k1", log=lines.append) == ""
    assert lines[1:] == [f"kernel precompile: manifest {path} lists {1 if gone == 'file' else 3} cache files that "
                         "are gone; compiling"]


@pytest.mark.parametrize("content", [
    b"\xff\xfe\x00garbage\x80", b'{"version": 1, "key": "k1", "specs": 2, "entr', b"[1, 2]", b"",
    b'{"version": 1, "key": "other", "specs": 2, "entries": {"AAAA": ["k.json"]}}',
    b'{"version": 1, "key": "k1", "specs": 2, "entries": {"AAAA": "k.json"}}',
    b'{"version": 1, "key": "k1", "specs": 2, "entries": {}}',
], ids=["bytes", "truncated", "list", "empty", "other-key", "files-not-a-list", "no-entries"])
def test_a_corrupt_manifest_is_ignored_in_one_line(cache, content):
    path = cache / MANIFESTS / "k1.json"
    path.parent.mkdir()
    path.write_bytes(content)
    lines: list[str] = []
    assert cached_step("k1", log=lines.append) == ""
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith(f"kernel precompile: manifest {path} ignored (")


def test_the_manifest_is_written_whole_or_not_at_all(cache, monkeypatch):
    """A write that fails before its rename leaves the manifest there was, no temporary file, and one line."""
    lines: list[str] = []
    path = write("k1", lines)
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    report = PrecompileReport(specs=1, compiled=1, entries=["AAAA"])
    assert write_manifest("k1", report, log=lines.append) is None
    assert lines[1:] == ["kernel precompile: no manifest written (OSError: [Errno 28] No space left on device)"]
    assert path.read_bytes() == before and os.listdir(path.parent) == [path.name]
    assert cached_step("k1", log=lines.append).startswith("cache holds the 2 kernels")


def test_nothing_is_written_without_entries_or_in_the_interpreter(cache, monkeypatch):
    lines: list[str] = []
    assert write_manifest("k1", PrecompileReport(specs=2, compiled=2), log=lines.append) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert manifest_path("k1") is None and cached_step("k1", log=lines.append) == ""
    assert write_manifest("k1", PrecompileReport(specs=2, entries=sorted(ENTRIES)), log=lines.append) is None
    assert lines == [] and not (cache / MANIFESTS).exists()


class FakePool:
    """Stands in for :class:`~kernels.precompile.KernelCompilePool`: answers with ``report``, compiles nothing."""

    def __init__(self, report: PrecompileReport) -> None:
        self.report = report

    def compile(self, specs) -> PrecompileReport:
        return self.report


def test_a_precompile_that_compiled_every_spec_leaves_the_manifest(cache, monkeypatch):
    monkeypatch.setattr(kernels.precompile, "skip_reason", lambda specs: "")
    specs = [kernels.precompile.LaunchSpec("m:k", (), (), ())]
    lines: list[str] = []
    failed = PrecompileReport(specs=1, failed=["k: boom"], workers=1, entries=["AAAA"])
    precompile(specs, pool=FakePool(failed), key="k1", log=lines.append)
    assert manifest_path("k1") is not None and not manifest_path("k1").exists()
    precompile(specs, pool=FakePool(PrecompileReport(specs=1, compiled=1, workers=1, entries=["AAAA"])), key="k1",
               log=lines.append)
    assert cached_step("k1", log=lines.append) == f"cache holds the 1 kernels of this step, manifest {manifest_path('k1')}"
    assert len(lines) == 3 and lines[-1].startswith("kernel precompile: manifest ")


class Unrecordable(torch.nn.Module):
    """A model whose step must not be recorded: recording it raises."""

    def forward(self, batch):
        raise AssertionError("recorded")

    def loss(self, batch, output):
        return {"loss": output}


def no_pool(*args, **kwargs):
    raise AssertionError("a compile pool was started")


def test_the_step_is_skipped_on_its_manifest_without_recording_or_a_pool(cache, monkeypatch):
    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    monkeypatch.setattr(kernels.precompile, "KernelCompilePool", no_pool)
    lines: list[str] = []
    path = write("k1", lines)
    assert warm_cache("k1") and not warm_cache("k2") and not warm_cache(None)
    assert len(lines) == 1  # the pool sites ask silently
    result = precompile_step(Unrecordable(), make_batch(CTR_SCHEMA, [2]), autocast_dtype=None, key="k1",
                             log=lines.append)
    assert result["cached"] and result["specs"] == 0 and result["workers"] == 0
    assert lines[1:] == [f"kernel precompile: skipped (cache holds the 2 kernels of this step, manifest {path})"]

    (cache / "AAAA" / "k.cubin").unlink()
    assert not warm_cache("k1")
    result = precompile_step(Unrecordable(), make_batch(CTR_SCHEMA, [2]), autocast_dtype=None, key="k1",
                             log=lines.append)
    assert not result["cached"] and result["skipped"].startswith("recording the step failed: AssertionError")


def test_the_skip_settles_the_kernel_keys_a_pool_would_have(cache, monkeypatch):
    """No pool starts on the warm path, and a pool's start is what settles the process's kernel keys
    (:func:`kernels.precompile.settle_cache_keys`): the skip settles them instead, at the sites that take it before
    the step's first launch (the harness and the bench ask :func:`warm_cache`). A settle that fails costs a line."""
    settled: list[None] = []
    monkeypatch.setattr(kernels.precompile, "settle_cache_keys", lambda modules=None: settled.append(modules) or 0)
    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    monkeypatch.setattr(kernels.precompile, "KernelCompilePool", no_pool)
    lines: list[str] = []
    write("k1", lines)
    assert not warm_cache("k2") and not settled  # no skip: the pool that starts settles them
    assert warm_cache("k1") and settled == [None]
    result = precompile_step(Unrecordable(), make_batch(CTR_SCHEMA, [2]), autocast_dtype=None, key="k1",
                             log=lines.append)
    assert result["cached"] and settled == [None, None]

    def broken(modules=None):
        raise ImportError("no module named kernels.triton.gone")

    monkeypatch.setattr(kernels.precompile, "settle_cache_keys", broken)
    assert cached_step("k1", log=lines.append).startswith("cache holds the 2 kernels of this step")
    assert lines[-1] == "kernel precompile: kernel cache keys not settled (ImportError: no module named kernels.triton.gone)"


def test_the_harness_starts_no_pool_on_a_warm_cache(cache, monkeypatch):
    """:class:`gem.train.PrecompileKernels`: the key from the module, no pool, the step skipped, and the line after
    the first step still taken (it shows whether the cache held what the manifest said)."""
    import gem.train
    from gem.loop import GraphConfig
    from gem.step_options import StepOptions

    monkeypatch.setattr(gem.train, "skip_reason", lambda specs: "")
    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    monkeypatch.setattr(gem.train, "KernelCompilePool", no_pool)
    options = StepOptions(autocast_dtype=None, cast_once=False, shapes=None, graphs=GraphConfig(),
                          precompile_kernels=True)
    module = SimpleNamespace(model=Unrecordable(), step_options=options, device=torch.device("cpu"),
                             cfg=SimpleNamespace(data=SimpleNamespace(train_split="train")))
    callback = gem.train.PrecompileKernels()
    key = step_key(gem.train.step_identity(module), autocast_dtype=None, device=module.device)
    lines: list[str] = []
    write(key, lines)
    callback.on_fit_start(None, module)
    assert callback.key == key and callback.pool is None
    callback.on_train_batch_start(None, module, make_batch(CTR_SCHEMA, [2]), 0)
    assert callback.report["cached"] and callback.cached == set(ENTRIES)


def test_the_bench_starts_no_pool_on_a_warm_cache(cache, monkeypatch):
    from experiments import bench_teacher

    monkeypatch.setattr(bench_teacher, "skip_reason", lambda specs: "")
    monkeypatch.setattr(gem.precompile, "skip_reason", lambda specs: "")
    monkeypatch.setattr(bench_teacher, "KernelCompilePool", no_pool)
    args = bench_teacher.build_parser().parse_args(["--flavor", "large", "--cpu-widths", "--precompile"])
    cfg = bench_teacher.teacher_config(args)
    data_cfg = bench_teacher.data_config(args, Path("/tmp/generated-world"), 64, 4096)
    device = torch.device("cuda")  # where a pool would start; nothing here touches the device
    key = bench_teacher.precompile_key(args, cfg, CTR_SCHEMA, data_cfg, device)
    other = bench_teacher.data_config(args, Path("/tmp/another-world"), 64, 4096)
    assert key == bench_teacher.precompile_key(args, cfg, CTR_SCHEMA, other, device)  # a fresh temporary world
    assert key != bench_teacher.precompile_key(args, cfg, CTR_SCHEMA, dataclasses.replace(other, token_budget=8192), device)
    write(key, [])
    assert bench_teacher.compile_pool(args, device, key) is None
    with pytest.raises(AssertionError, match="a compile pool was started"):
        bench_teacher.compile_pool(args, device, "not-warm")
    args.precompile = False
    assert bench_teacher.precompile_key(args, cfg, CTR_SCHEMA, data_cfg, device) is None

