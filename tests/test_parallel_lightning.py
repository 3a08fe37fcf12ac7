"""``gem train`` through ``GemParallelStrategy`` on real processes (torchrun, gloo, CPU).

Three runs of a tiny teacher on a tiny dataset, ``STEPS`` steps of one global batch each:

1. one process, uninterrupted (the reference);
2. ``torchrun --nproc_per_node 2 --max-restarts 1``: rank 1 SIGKILLs itself at step ``KILL_AT[0]``;
   torchrun restarts both ranks, which resume from the DCP checkpoint before it; rank 1 dies again at
   ``KILL_AT[1]``, and with no restart left the job fails;
3. the job relaunched as one process in the same run directory: it reshards the last 2-rank
   checkpoint to 1 rank and finishes at ``STEPS``.

Runs 2 + 3 must give the reference's losses step by step and its final parameters, only rank 0 may
open an MLflow run, and the example ids trained at each step (recorded by every rank through a
callback, the last attempt of a step winning) must be exactly the reference's: nothing lost or
duplicated. The module is also the torchrun entry point (``python -m tests.test_parallel_lightning``):
``gem train`` with that callback added.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlflow
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from foundation.config import ConfigError, apply_overrides
from foundation.parallel.settings import ParallelSettings
from gem.config import ExperimentConfig
from tests.events import write_dataset

REPO = Path(__file__).resolve().parents[1]
STEPS, CHECKPOINT_EVERY = 10, 3
KILL_AT = (5, 8)  # per torchrun attempt: after the checkpoints at steps 3 and 6
LOSS_TOLERANCE = 1e-5
# AdamW turns float-noise gradients (~1e-9, summed in another order across ranks) into steps of up to
# lr * 1e-3 on a few parameters; over STEPS steps that stays well below this.
PARAM_TOLERANCE = 1e-4
RUN_TIMEOUT_S = 400
# Each rank reads its own row groups (no balancing); per-rank batches of 12 rows.
OWN_STREAMS = ["parallel.balance=false", "data.batch_size=12"]
# Both ranks read the whole global batch; the MLP pairs are split column/row-wise (gradient clipping
# then spans DTensors on the (dp_shard, tp) and the dp_shard meshes).
TENSOR_PARALLEL = ["parallel.dp_shard=1", "parallel.tp=2"]


def train_args(dataset: Path, out: Path) -> list[str]:
    """``gem train`` arguments: the debug teacher with deterministic per-row losses.

    Dropout and the generative loss's sampled negatives draw different random numbers per rank, and
    a masked per-task mean (conversion labels are partly absent) is not a mean over rows, so the
    reference comparison uses the click loss alone, without dropout or the generative objective.
    """
    return [
        "train",
        "--flavor",
        "teacher-debug",
        f"data.path={dataset}",
        "data.batch_size=24",
        "data.token_budget=0",
        f"train.out_dir={out}",
        f"train.tracking_uri=sqlite:///{out}/mlflow.db",
        "train.max_epochs=1",
        f"train.max_steps={STEPS}",
        f"train.checkpoint_every_n_steps={CHECKPOINT_EVERY}",
        "train.log_every_n_steps=1",
        "train.progress_bar=false",
        "parallel.enabled=true",
        "model.teacher.generative=false",
        "model.teacher.dropout=0.0",
        'model.teacher.loss_weights={"click": 1.0, "conversion": 0.0}',
    ]


class ExampleTrace(Callback):
    """Appends ``{"run", "attempt", "step", "ids"}`` per training batch (this rank's rows) to
    ``trace_dir/rank<r>.jsonl``; rank ``kill_rank`` SIGKILLs itself when step ``kill_at[attempt]`` starts."""

    def __init__(self, trace_dir: Path, kill_at: tuple[int, ...], kill_rank: int) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.path = trace_dir / f"rank{self.rank}.jsonl"
        self.kill_at = kill_at[self.attempt] if self.rank == kill_rank and self.attempt < len(kill_at) else -1
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        record = {"attempt": self.attempt, "run": os.environ.get("TRACE_RUN", ""), "step": trainer.global_step}
        with open(self.path, "a") as f:
            f.write(json.dumps({**record, "ids": batch.example_id.tolist()}) + "\n")


def main() -> None:
    """``gem train`` with :class:`ExampleTrace` added (``TRACE_DIR``, ``KILL_AT``, ``KILL_RANK`` from the environment)."""
    import gem.train as train_module
    from gem.cli import main as gem_main

    build_trainer = train_module.build_trainer

    def build_traced_trainer(cfg, *args):
        trainer = build_trainer(cfg, *args)
        kill_at = tuple(int(s) for s in os.environ["KILL_AT"].split(",") if s)
        trace = ExampleTrace(Path(os.environ["TRACE_DIR"]), kill_at, int(os.environ["KILL_RANK"]))
        trainer.callbacks.append(trace)
        return trainer

    train_module.build_trainer = build_traced_trainer
    sys.exit(gem_main(sys.argv[1:]))


def launch(args: list[str], trace: Path, *, nproc: int = 0, kill_at: tuple[int, ...] = (), tag: str = "") -> subprocess.Popen:
    """This module as ``gem train`` in one process (``nproc=0``) or under torchrun with one restart allowed."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TRACE_DIR": str(trace),
        "TRACE_RUN": tag,
        "KILL_AT": ",".join(map(str, kill_at)),
        "KILL_RANK": "1",
    }
    entry = ["-m", "tests.test_parallel_lightning", *args]
    if nproc:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        cmd = [*torchrun, "--standalone", "--max-restarts", "1", *entry]
    else:
        cmd = [sys.executable, *entry]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, name: str, *, expect_failure: bool = False) -> str:
    out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert (proc.returncode != 0) == expect_failure, f"{name}: exit code {proc.returncode}:\n{out[-6000:]}"
    return out


def effective_trace(trace: Path) -> dict[int, list[int]]:
    """Step -> sorted example ids trained at that step by all ranks of the last attempt that ran it."""
    by_step: dict[int, dict[tuple[str, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    for file in sorted(trace.glob("rank*.jsonl")):
        for line in file.read_text().splitlines():
            r = json.loads(line)
            by_step[r["step"]][(r["run"], r["attempt"])].extend(r["ids"])
    return {step: sorted(attempts[max(attempts)]) for step, attempts in sorted(by_step.items())}


def losses(out: Path) -> tuple[int, dict[int, float]]:
    """(number of MLflow runs, step -> last logged ``train/global_loss``) of a run directory's tracking db."""
    client = mlflow.MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = sorted(client.get_metric_history(runs[0].info.run_id, "train/global_loss"), key=lambda m: m.timestamp)
    return len(runs), {m.step: m.value for m in history}


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "teacher-debug" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference run and the killed 2-rank job (concurrently), then its 1-rank relaunch."""
    root = tmp_path_factory.mktemp("lightning")
    dataset = write_dataset(root / "data", rows={"train": 360, "valid": 48, "test": 48}, row_group_size=30)
    ref, cut, own, tp = root / "ref", root / "cut", root / "own", root / "tp"
    started = time.perf_counter()
    reference = launch(train_args(dataset, ref), ref / "trace")
    killed = launch(train_args(dataset, cut), cut / "trace", nproc=2, kill_at=KILL_AT)
    own_streams = launch([*train_args(dataset, own), *OWN_STREAMS], own / "trace", nproc=2, kill_at=KILL_AT[:1])
    killed_log = finish(killed, "torchrun 2 ranks, killed twice", expect_failure=True)
    finish(reference, "reference")
    relaunched = launch(train_args(dataset, cut), cut / "trace", tag="relaunched")
    tensor_parallel = launch([*train_args(dataset, tp), *TENSOR_PARALLEL], tp / "trace", nproc=2)
    finish(own_streams, "torchrun 2 ranks, own streams, killed once")
    finish(relaunched, "1-rank relaunch")
    finish(tensor_parallel, "torchrun 2 ranks, tensor parallel")
    print(f"parallel lightning runs: {time.perf_counter() - started:.1f} s")
    return {"ref": ref, "cut": cut, "own": own, "tp": tp, "dataset": dataset, "killed_log": killed_log}


def test_killed_two_rank_run_restarts_and_one_rank_continuation_match_single_process(runs):
    ref, cut = runs["ref"], runs["cut"]
    checkpoints = sorted(p.name for p in (cut / "teacher-debug" / "checkpoints" / "last.dcp").glob("step_*"))
    assert checkpoints[-1] == f"step_{STEPS:08d}"
    ref_runs, ref_loss = losses(ref)
    cut_runs, cut_loss = losses(cut)
    # Rank 1 never opened a run, and the restarted and resumed rank 0 reopened rank 0's.
    assert ref_runs == cut_runs == 1
    assert sorted(ref_loss) == sorted(cut_loss) == list(range(STEPS))
    for step in range(STEPS):
        assert cut_loss[step] == pytest.approx(ref_loss[step], abs=LOSS_TOLERANCE), step
    ref_state, cut_state = final_state(ref), final_state(cut)
    assert ref_state.keys() == cut_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(cut_state[name], value, atol=PARAM_TOLERANCE, rtol=0, msg=name)


def test_tensor_parallel_through_gem_train_matches_single_process(runs):
    ref_loss, tp_loss = losses(runs["ref"])[1], losses(runs["tp"])[1]
    assert sorted(tp_loss) == list(range(STEPS))
    for step in range(STEPS):
        assert tp_loss[step] == pytest.approx(ref_loss[step], abs=LOSS_TOLERANCE), step
    ref_state, tp_state = final_state(runs["ref"]), final_state(runs["tp"])
    for name, value in ref_state.items():
        torch.testing.assert_close(tp_state[name], value, atol=PARAM_TOLERANCE, rtol=0, msg=name)


def test_no_example_lost_or_duplicated_across_kill_and_reshard(runs):
    ref_trace, cut_trace = effective_trace(runs["ref"] / "trace"), effective_trace(runs["cut"] / "trace")
    assert list(ref_trace) == list(range(STEPS))
    assert cut_trace == ref_trace
    consumed = [i for ids in cut_trace.values() for i in ids]
    assert len(consumed) == len(set(consumed)) == STEPS * 24
    # Rank 1 died where it was told to, each attempt after training steps past its last checkpoint
    # (lost, then trained again), and the relaunch resumed after the last checkpoint.
    records = [json.loads(line) for line in (runs["cut"] / "trace" / "rank1.jsonl").read_text().splitlines()]
    last_step = {(r["run"], r["attempt"]): r["step"] for r in records}
    assert last_step == {("", 0): KILL_AT[0] - 1, ("", 1): KILL_AT[1] - 1}
    first_step: dict[tuple[str, int], int] = {}
    for line in (runs["cut"] / "trace" / "rank0.jsonl").read_text().splitlines():
        r = json.loads(line)
        first_step.setdefault((r["run"], r["attempt"]), r["step"])
    assert first_step == {("", 0): 0, ("", 1): 3, ("relaunched", 0): 6}
    assert runs["killed_log"].count("SIGKILL") >= 2


def test_only_rank0_logs_system_metrics_with_a_node_id_and_the_imbalance(runs):
    client = mlflow.MlflowClient(f"sqlite:///{runs['cut']}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert any(k.startswith("system/node0/") for k in run.data.metrics)
    assert run.data.params["parallel.enabled"] == "True" and run.data.params["parallel.dp_shard"] == "-1"
    # Resolved degrees, as tags: the relaunch at one process rewrote the 2-rank job's.
    assert run.data.tags["gem.parallel.world_size"] == "1" and run.data.tags["gem.parallel.dp_shard"] == "1"
    imbalance = client.get_metric_history(run.info.run_id, "parallel/imbalance")
    assert imbalance and all(m.value >= 1.0 for m in imbalance)


def test_ranks_reading_their_own_row_groups_resume_each_stream_where_it_stopped(runs):
    """``parallel.balance=false``: rank r trains on the pipeline's stream r of 2, batch after batch, across
    a SIGKILL and torchrun's restart (the data positions of both ranks are in the checkpoint)."""
    from foundation.data.pipeline import EventStream
    from gem.cli import load_flavor

    cfg = load_flavor("teacher-debug", [*train_args(runs["dataset"], runs["own"])[3:], *OWN_STREAMS])
    for rank in range(2):
        by_step: dict[int, dict[int, list[int]]] = defaultdict(dict)
        for line in (runs["own"] / "trace" / f"rank{rank}.jsonl").read_text().splitlines():
            r = json.loads(line)
            by_step[r["step"]][r["attempt"]] = r["ids"]
        trained = [attempts[max(attempts)] for _, attempts in sorted(by_step.items())]
        assert {1} <= {a for attempts in by_step.values() for a in attempts}  # it was restarted
        stream = EventStream(cfg.data.path, "train", cfg.data, training=True, rank=rank, world_size=2)
        expected = [batch.example_id.tolist() for batch, _ in zip(stream, range(STEPS), strict=False)]
        assert trained == expected, rank


@pytest.mark.parametrize(
    ("overrides", "world", "field"),
    [
        (["parallel.dp_shard=2"], 3, "parallel.dp_shard"),
        (["parallel.tp=0"], 2, "parallel.tp"),
        (["parallel.dp_shard=-1", "parallel.tp=-1"], 4, "parallel.tp"),
        (["parallel.emb_shard=3"], 4, "parallel.emb_shard"),
        (["parallel.backend=mpi"], 1, "parallel.backend"),
    ],
)
def test_bad_parallel_settings_name_the_field(overrides, world, field):
    cfg = apply_overrides(ExperimentConfig(), overrides)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg.parallel.validate(world)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.sharding_types=(diagonal,)", "parallel.sharding_types"),
        ("parallel.sparse_optimizer=lion", "parallel.sparse_optimizer"),
        ("parallel.param_dtype=fp8", "parallel.param_dtype"),
        ("parallel.cp_attention=ring", "parallel.cp_attention"),
    ],
)
def test_bad_parallel_options_name_the_field(override, field):
    from foundation.parallel.strategy import build_parallel_config

    cfg = apply_overrides(ExperimentConfig(), [override])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_parallel_config(cfg.parallel)


def test_parallel_settings_are_overridable_and_logged_flat():
    cfg = apply_overrides(ExperimentConfig(), ["parallel.enabled=true", "parallel.dp_shard=2", "parallel.tp=2"])
    assert cfg.parallel == ParallelSettings(enabled=True, dp_shard=2, tp=2)
    cfg.parallel.validate(4)
    flat = cfg.flat()
    assert flat["parallel.dp_shard"] == 2 and flat["parallel.tp"] == 2 and flat["parallel.balance"] is True


if __name__ == "__main__":
    main()
