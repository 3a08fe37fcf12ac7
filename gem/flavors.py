"""The one registry of named configs: synthetic worlds, teacher sizes, experiment flavors, pipeline presets.

Every name a user can pass (``--preset``, ``--flavor``, ``--teacher-flavor``) is looked up here, through
:func:`lookup`: an unknown one is a :class:`~foundation.config.ConfigError` listing the known names, and
every lookup returns a fresh copy the caller may change.

- :data:`SYNTH_PRESETS`: synthetic ads worlds (``gem data synth --preset``). ``debug`` generates in
  seconds, ``default`` is ``make quickstart``'s, ``sequential`` adds order-dependent clicks (item-to-item
  transitions), ``large`` feeds GPU teachers.
- :data:`TEACHER_FLAVORS`: :class:`~foundation.model.teacher_config.TeacherConfig` sizes of the GEM teacher.
- :data:`FLAVORS`: experiments (``gem train --flavor``). ``debug`` (DLRM baseline) trains in seconds on a
  CPU; ``default`` is ``make quickstart``; ``teacher-*`` train the GEM teacher on the synthetic world;
  ``ml1m_hstu*`` reproduce HSTU on MovieLens-1M (``gem data convert --format seq-tsv --input
  .../sequences.tsv --out data/ml1m``); ``student-*`` train the small value model.
- :data:`PRESET_FLAVORS`: the teacher and student flavors ``gem pipeline --preset`` trains on each world.

A student learns from a teacher through teacher outputs, e.g. ``gem train --flavor student-debug-ah-sa
'transfer.teacher_outputs={"train": "to/train", "valid": "to/valid"}'``. Each transfer method is a list of
overrides (:data:`STUDENT_METHODS`); representation transfer also needs the teacher's dims:
``model.student.teacher_repr=true model.student.user_repr_dim=64 model.student.item_repr_dim=64``
(:func:`repr_overrides` reads them from a teacher-output manifest); parameter sharing
(:data:`SHARING_METHODS`) needs the teacher checkpoint: ``transfer.share_from=PATH`` (:func:`sharing_overrides`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import TypeVar

from foundation.config import ConfigError, apply_overrides
from foundation.data.pipeline import DataConfig
from foundation.data.synthetic import SynthConfig
from foundation.model.baseline import DLRMConfig
from foundation.model.teacher_config import TeacherConfig
from gem.config import ExperimentConfig, ModelConfig, TrainConfig
from value_models.student import StudentConfig

T = TypeVar("T")


def lookup(table: Mapping[str, T], kind: str, name: str) -> T:
    """A deep copy of ``table[name]``; an unknown name raises :class:`ConfigError` naming the ``kind`` and the known names."""
    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return copy.deepcopy(table[name])


# -- synthetic worlds -----------------------------------------------------------------------------

SYNTH_PRESETS: dict[str, SynthConfig] = {
    # seconds: for tests and smoke runs
    "debug": SynthConfig(
        num_users=2_000,
        num_items=1_000,
        num_examples=40_000,
        max_history=256,
        rows_per_shard=8_192,
        users_per_block=512,
        num_topics=12,
        num_advertisers=60,
        history_median=80.0,
        history_limit=20_000,
    ),
    # `make quickstart`: generation well under a minute on two CPU cores
    "default": SynthConfig(),
    # the scaling sweep's world (2M impressions, 1,024-event histories) plus item-to-item transitions: the history
    # chains items to their successors and the click odds rise for a successor of the last few events, so reading
    # the order of the history pays; each successor shares its item's topic, so the relation is learnable by
    # comparing items rather than only pair by pair (docs/benchmarks.md, "A world that rewards order")
    "sequential": SynthConfig(
        num_examples=2_000_000,
        max_history=1_024,
        users_per_block=1_024,
        transition_rate=0.3,
        transition_target_frac=0.2,
        transition_weight=2.5,
        transition_locality=1.0,
    ),
    # on demand, for GPU teachers: tens of millions of rows with histories up to 4096 events
    "large": SynthConfig(
        num_users=2_000_000,
        num_items=500_000,
        num_examples=20_000_000,
        max_history=4_096,
        rows_per_shard=16_384,
        users_per_block=256,
        num_topics=64,
        num_advertisers=20_000,
        window_days=28.0,
        history_median=150.0,
    ),
}


def synth_preset(name: str, **overrides) -> SynthConfig:
    """A fresh copy of ``SYNTH_PRESETS[name]`` with ``overrides`` applied."""
    return dataclasses.replace(lookup(SYNTH_PRESETS, "synthetic preset", name), **overrides)


# -- teacher sizes --------------------------------------------------------------------------------


def _ml1m_teacher(num_layers: int, num_heads: int) -> TeacherConfig:
    """HSTU's published ML-1M setup: item ids only, relative position+time bias, d=50, dropout 0.2,
    sampled softmax with 128 uniform negatives per position at temperature 0.05 on L2-normalised
    embeddings (``negatives=batch`` shares them per batch: the A/B in docs/benchmarks.md)."""
    return TeacherConfig(
        d_model=50,
        item_dim=50,
        num_layers=num_layers,
        num_heads=num_heads,
        attn_dim=50 // num_heads,
        value_dim=50 // num_heads,
        max_len=200,
        time_buckets=128,
        dropout=0.2,
        abs_pos_emb=True,
        history_features=(),
        interleave=False,
        num_cls=0,
        num_pma_seeds=0,
        num_recent=0,
        target_aware=False,
        num_negatives=128,
        negatives="position",
        in_batch_negatives=False,
        temperature=0.05,
        # HSTU's reference implementation does not scale QKᵀ.
        attn_alpha=1.0,
        # One bias table per layer, shared by its heads, as the reference (A/B in docs/benchmarks.md).
        rel_bias="shared",
    )


def _debug_teacher() -> TeacherConfig:
    """Seconds on a CPU: every block present, tiny widths."""
    return TeacherConfig(
        d_model=32,
        item_dim=32,
        num_layers=2,
        num_heads=2,
        attn_dim=16,
        value_dim=16,
        max_len=64,
        time_buckets=32,
        num_cls=2,
        num_pma_seeds=2,
        num_recent=4,
        pffn_hidden=64,
        interaction_tokens=6,
        num_final_interaction_blocks=1,
        wukong_rank=4,
        wukong_hidden=64,
        dcn_rank=16,
        expert_hidden=64,
        expert_dim=32,
        repr_dim=32,
        num_negatives=32,
        generative=True,
    )


def _sasrec_teacher() -> TeacherConfig:
    """The SASRec baseline of HSTU's ML-1M table on the same data path, loss and evaluation: 2 blocks, 1
    head, d=50, learned absolute positions, FFN 50 wide, dropout 0.2, scaled dot-product softmax."""
    return _ml1m_teacher(num_layers=2, num_heads=1).replace(
        sequence_block="sasrec", time_buckets=0, ffn_hidden=50, attn_alpha=None
    )


TEACHER_FLAVORS: dict[str, TeacherConfig] = {
    # `debug` and `large` train the generative next-item objective beside click/conversion, which makes
    # score_items meaningful on ctr data; on the default world it cost click NE (docs/benchmarks.md,
    # "Teacher against the DLRM baseline"), so `small`, the measured ranking recipe, leaves it off.
    "debug": _debug_teacher(),
    # The ctr recipe measured to beat the DLRM on the default world (docs/benchmarks.md, "What made the
    # teacher win"): the `debug` widths, HSTU without InterFormer interleaving, and no CLS or K-most-recent summary
    # tokens (the per-user detail they carry is what a ranker memorises within one epoch); the
    # candidate attends to the history, PMA seeds and the pooled-history tokens summarise it, and the
    # generative loss is off (it cost click NE on this data). At d=128 with every summary token the
    # same model memorised within one epoch and lost to the DLRM by .04 NE. 64 events is what was
    # measured (it beat 32, and the DLRM at 256); longer histories need the GPU's kernels to train fast.
    "small": _debug_teacher().replace(interleave=False, num_cls=0, num_recent=0, generative=False),
    # Sized for one H200 with long sequences (a token budget of ~16k tokens per batch was measured; the
    # generative loss shares its 512 negatives per batch, see docs/benchmarks.md):
    # ~85M parameters in the HSTU blocks and ~410M dense parameters in all; the sequence arch
    # (blocks, PFFN, PMA, attention) takes almost all the FLOPs.
    "large": TeacherConfig(
        d_model=1024,
        item_dim=256,
        num_layers=16,
        num_heads=8,
        attn_dim=128,
        value_dim=128,
        max_len=4096,
        # The last 128 events' distances exact, one bucket for the farther ones (whose age the time bias still
        # tells apart): the attention kernels skip the position table on the far tiles (docs/benchmarks.md).
        position_window=128,
        time_buckets=128,
        # The item and feature tables step only the rows a batch looks up, with AdamW's result (deferred rows):
        # the optimizer no longer reads and writes every row of them at every step.
        sparse_tables=True,
        num_cls=4,
        num_pma_seeds=8,
        num_recent=16,
        pffn_hidden=1024,
        pffn_summary_dim=32,
        interaction_tokens=16,
        num_final_interaction_blocks=3,
        wukong_rank=16,
        wukong_hidden=512,
        dcn_rank=32,
        expert_hidden=512,
        expert_dim=256,
        num_shared_experts=4,
        num_domain_experts=2,
        repr_dim=256,
        num_negatives=512,
        generative=True,
        # The residual stream in the autocast dtype (bf16 on the GPU), as torchtitan's and Megatron's residuals:
        # the norms that read and write it move fewer bytes. Losses over the same batches and a 16-layer proxy's
        # test metrics matched the float32 stream's within their noise (docs/benchmarks.md, sessions 32-34).
        stream_dtype="autocast",
    ),
    "ml1m_hstu": _ml1m_teacher(num_layers=2, num_heads=1),
    "ml1m_hstu_large": _ml1m_teacher(num_layers=8, num_heads=2),
    "sasrec": _sasrec_teacher(),
}


def teacher_flavor(name: str) -> TeacherConfig:
    """A fresh copy of a named teacher config (callers may mutate it)."""
    return lookup(TEACHER_FLAVORS, "teacher flavor", name)


# -- experiment flavors ---------------------------------------------------------------------------


def _debug() -> ExperimentConfig:
    return ExperimentConfig(
        name="debug",
        data=DataConfig(path="data/synth-debug", max_len=64, batch_size=128, token_budget=4096),
        model=ModelConfig(arch="dlrm", dlrm=DLRMConfig(embedding_dim=16, bottom_mlp=(32,), top_mlp=(64, 32))),
        train=TrainConfig(max_epochs=2, lr=3e-3, checkpoint_every_n_steps=10, log_every_n_steps=5),
    )


def _default() -> ExperimentConfig:
    return ExperimentConfig(
        name="default",
        data=DataConfig(path="data/synth-default", max_len=256, batch_size=512, token_budget=65536),
        model=ModelConfig(arch="dlrm", dlrm=DLRMConfig(embedding_dim=32)),
        train=TrainConfig(max_epochs=1, lr=2e-3, checkpoint_every_n_steps=100, log_every_n_steps=20),
    )


def _teacher(
    name: str, teacher: str, data_path: str, *, batch_size: int, token_budget: int, shuffle_window: int = 1,
    num_workers: int = 0, pin_memory: bool = False, **train
) -> ExperimentConfig:
    """A GEM-teacher experiment; the data's ``max_len`` follows the teacher's, which fixes HSTU's 1/N."""
    cfg = teacher_flavor(teacher)
    return ExperimentConfig(
        name=name,
        data=DataConfig(
            path=data_path,
            max_len=cfg.max_len,
            batch_size=batch_size,
            token_budget=token_budget,
            shuffle_window=shuffle_window,
            num_workers=num_workers,
            pin_memory=pin_memory,
        ),
        model=ModelConfig(arch="teacher", teacher=cfg),
        train=TrainConfig(**{"max_epochs": 1, "lr": 1e-3, "checkpoint_every_n_steps": 200, **train}),
    )


def _student(name: str, data_path: str, *, history_len: int, batch_size: int, **train) -> ExperimentConfig:
    """A student ranker with no transfer; :data:`STUDENT_METHODS` turn a transfer method on."""
    return ExperimentConfig(
        name=name,
        data=DataConfig(path=data_path, max_len=history_len, batch_size=batch_size),
        model=ModelConfig(arch="student", student=StudentConfig(embedding_dim=8, hidden=(64, 32), history_len=history_len)),
        train=TrainConfig(**{"max_epochs": 1, "lr": 3e-3, "checkpoint_every_n_steps": 100, **train}),
    )


# Validation (full ranking of the valid split) every 10 epochs and after the last, as experiments.ml1m_hstu
# evaluates; what a pass costs against an epoch: docs/benchmarks.md ("Host time of the step").
_ML1M_TRAIN = {
    "batch_size": 128, "token_budget": 0, "shuffle_window": 0, "max_epochs": 100, "log_every_n_steps": 50,
    "check_val_every_n_epoch": 10,
}

_AH_SA = ("model.student.distill=ah", "model.student.use_adapter=true")
# Transfer method -> overrides of a student flavor. ``repr`` methods also need :func:`repr_overrides`,
# :data:`SHARING_METHODS` also :func:`sharing_overrides`. ``sharing`` is parameter sharing alone (true
# labels only); ``ah-sa-sharing`` adds it to AH + SA; ``full`` is the whole stack, AH + SA + sharing +
# representations.
STUDENT_METHODS: dict[str, tuple[str, ...]] = {
    "alone": (),
    "kd": ("model.student.distill=kd",),
    "ah": ("model.student.distill=ah",),
    "ah-sa": _AH_SA,
    "ah-sa-repr": (*_AH_SA, "model.student.teacher_repr=true"),
    "sharing": (),
    "ah-sa-sharing": _AH_SA,
    "full": (*_AH_SA, "model.student.teacher_repr=true"),
}
# Methods whose students start from the teacher's tables.
SHARING_METHODS = ("sharing", "ah-sa-sharing", "full")


def repr_overrides(user_repr_dim: int, item_repr_dim: int) -> tuple[str, ...]:
    """Overrides giving a student the teacher's representation dims (from a teacher-output schema)."""
    return (f"model.student.user_repr_dim={user_repr_dim}", f"model.student.item_repr_dim={item_repr_dim}")


def sharing_overrides(teacher_ckpt: str, policy: str = "freeze", lr_scale: float = 0.1) -> tuple[str, ...]:
    """Overrides that start a student from the tables of ``teacher_ckpt`` (:mod:`transfer.sharing`)."""
    return (
        f"transfer.share_from={teacher_ckpt}", f"transfer.share_policy={policy}", f"transfer.share_lr_scale={lr_scale}"
    )


def with_method(make: Callable[[], ExperimentConfig], method: str) -> Callable[[], ExperimentConfig]:
    """The flavor ``make`` with transfer method ``method`` on, named ``{name}-{method}``."""

    def build() -> ExperimentConfig:
        cfg = apply_overrides(make(), list(STUDENT_METHODS[method]))
        cfg.name = f"{cfg.name}-{method}"
        return cfg

    return build


# Methods whose flavors need nothing from a particular teacher (``ah-sa-repr`` needs its dims, sharing its checkpoint).
TEACHER_FREE_METHODS = ("kd", "ah", "ah-sa")


def _student_debug() -> ExperimentConfig:
    return _student(
        "student-debug", "data/synth-debug", history_len=8, batch_size=128, max_epochs=2, checkpoint_every_n_steps=10,
        log_every_n_steps=5,
    )


def _student_default() -> ExperimentConfig:
    return _student("student-default", "data/synth-default", history_len=16, batch_size=512, log_every_n_steps=20)


FLAVORS: dict[str, Callable[[], ExperimentConfig]] = {
    "student-debug": _student_debug,
    **{f"student-debug-{m}": with_method(_student_debug, m) for m in TEACHER_FREE_METHODS},
    "student-default": _student_default,
    **{f"student-default-{m}": with_method(_student_default, m) for m in TEACHER_FREE_METHODS},
    "debug": _debug,
    "default": _default,
    "teacher-debug": lambda: _teacher(
        "teacher-debug", "debug", "data/synth-debug", batch_size=128, token_budget=8192, max_epochs=2,
        checkpoint_every_n_steps=10, log_every_n_steps=5,
    ),
    # Two epochs: the recipe's best valid epoch was the first or the second over five seeds.
    "teacher-small": lambda: _teacher(
        "teacher-small", "small", "data/synth-default", batch_size=256, token_budget=65536, max_epochs=2
    ),
    # One GPU, the step as experiments.bench_teacher measured it fastest (docs/benchmarks.md, "Issue 15, the
    # host"): batches read and padded in 4 workers into pinned memory, parameters cast once per step, padded
    # batches on static buffers with the dense step replayed from CUDA graphs. The bench's buckets were
    # (64,72) at 512 events and (64,128) at 4,096; the larger ones take the rarer batches of many short rows.
    # The bench's learning rate too: the smaller teachers' 1e-3 diverged at this width (docs/benchmarks.md,
    # "Issue 15, session 46").
    "teacher-large": lambda: _teacher(
        "teacher-large", "large", "data/synth-large", batch_size=512, token_budget=16384, num_workers=4,
        pin_memory=True, precision="bf16-mixed", bucket_rows=(64, 128, 256, 512), cuda_graphs=True, lr=1e-4,
    ),
    # ML-1M: every epoch one permutation of all users (shuffle_window=0), as the reference's sampler.
    "ml1m_hstu": lambda: _teacher("ml1m_hstu", "ml1m_hstu", "data/ml1m", **_ML1M_TRAIN),
    "ml1m_hstu_large": lambda: _teacher("ml1m_hstu_large", "ml1m_hstu_large", "data/ml1m", **_ML1M_TRAIN),
    "sasrec": lambda: _teacher("sasrec", "sasrec", "data/ml1m", **_ML1M_TRAIN),
}


def get_flavor(name: str) -> ExperimentConfig:
    """A fresh experiment config of the named flavor (callers may mutate it)."""
    return lookup(FLAVORS, "flavor", name)()


# -- pipeline presets -----------------------------------------------------------------------------

# Synthetic preset -> (teacher flavor, student flavor) that ``gem pipeline`` trains on it.
PRESET_FLAVORS: dict[str, tuple[str, str]] = {
    "debug": ("teacher-debug", "student-debug"),
    "default": ("teacher-small", "student-default"),
}


# -- the quickstart mission -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MissionRecipe:
    """What ``gem quickstart`` runs (:mod:`gem.quickstart`): a synthetic world, the DLRM ``baseline`` and GEM
    ``teacher`` trained on its ``train`` window, ``student`` flavors on the later ``student_split`` window
    (alone and with each of ``methods``, the last one the transfer stack that is packaged and served), over
    ``seeds`` student seeds, all scored on ``test``; the packaged student must meet ``p99_ms`` at
    ``max_candidates`` on one CPU thread. ``distilled`` is the method the report's ``student_distilled`` and
    transfer ratio are of. ``*_overrides`` are dotted overrides of each flavor."""

    preset: str
    baseline: str
    teacher: str
    student: str
    methods: tuple[str, ...]
    seeds: int = 3
    student_split: str = "valid"
    synth_overrides: tuple[str, ...] = ()
    baseline_overrides: tuple[str, ...] = ()
    teacher_overrides: tuple[str, ...] = ()
    student_overrides: tuple[str, ...] = ()
    max_candidates: int = 256
    # Generous: the quickstart runs on shared machines, where a descheduled thread stretches wall p99 (a
    # 1 ms p99 on a free core measured 5-13 ms at load averages 5-14, docs/benchmarks.md, "Value-model
    # serving latency"); `gem package` defaults to 2 ms.
    p99_ms: float = 20.0
    data_path: str = ""
    distilled: str = "kd"

    def __post_init__(self) -> None:
        if self.distilled not in self.methods:
            raise ConfigError(f"MissionRecipe: distilled={self.distilled!r} is not one of its methods {list(self.methods)}")

    @property
    def dataset(self) -> str:
        """Where the world is generated (``data/synth-<preset>`` unless set)."""
        return self.data_path or f"data/synth-{self.preset}"


# The GEM teacher's ranking recipe (`small`: no generative loss, no interleaving, no CLS or recent tokens)
# at the debug widths.
_RANKING_TEACHER = (
    "model.teacher.generative=false", "model.teacher.interleave=false", "model.teacher.num_cls=0",
    "model.teacher.num_recent=0",
)

# The quickstart's world: the `debug` world with active users (a few events a day) whose focus moves every
# few days, so that the current interest sits in the last few events, where order and recency matter and a
# pooled bag dilutes it; a long-term core interest that only a long history shows; strong interest effects
# and a small catalogue, so that minutes of training learn them (the click rate is ~30%, not an ad rate).
# On the plain `debug` world the teacher's lead over the DLRM was smaller than the spread over training seeds.
_QUICKSTART_WORLD = (
    "num_items=200", "num_examples=100000", "tenure_days=(15.0,60.0)", "phase_days=4.0", "core_rate=0.1",
    "focus_rate=0.45", "core_weight=3.0", "recent_weight=4.0", "domain_base_cvr=(0.008,0.006,0.03)",
)
# The ranking teacher with the 4 most recent history tokens back in its summary (in that world they carry the
# current interest), no dropout (one epoch on a CPU is far from memorising), one epoch (the second one kept
# its lead over the DLRM but doubled the quickstart's longest stage).
_QUICKSTART_TEACHER = (
    *_RANKING_TEACHER, "model.teacher.num_recent=4", "model.teacher.dropout=0.0", "train.max_epochs=1",
)

MISSION_RECIPES: dict[str, MissionRecipe] = {
    # `make quickstart`: every stage of the mission in minutes on a 2-core CPU. The DLRM is the `debug`
    # flavor as it is (pooled history bag of 64 events, 2 epochs at lr 3e-3).
    "debug": MissionRecipe(
        preset="debug",
        baseline="debug",
        teacher="teacher-debug",
        student="student-debug",
        methods=("kd", "full"),
        synth_overrides=_QUICKSTART_WORLD,
        teacher_overrides=_QUICKSTART_TEACHER,
        data_path="data/quickstart",
    ),
    # Seconds: the chain on a tiny world, for tests and smoke runs (the comparison means nothing at this size).
    "tiny": MissionRecipe(
        preset="debug",
        baseline="debug",
        teacher="teacher-debug",
        student="student-debug",
        methods=("kd", "full"),
        seeds=2,
        synth_overrides=("num_users=300", "num_items=200", "num_examples=3000", "rows_per_shard=1000", "users_per_block=100"),
        baseline_overrides=("train.max_epochs=1",),
        teacher_overrides=(*_RANKING_TEACHER, "train.max_epochs=1"),
        student_overrides=("train.max_epochs=1",),
        data_path="data/quickstart-tiny",
    ),
}


def mission_recipe(name: str) -> MissionRecipe:
    """The named quickstart recipe (:data:`MISSION_RECIPES`)."""
    return lookup(MISSION_RECIPES, "quickstart recipe", name)
