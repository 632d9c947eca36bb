"""The typed configuration of asyncrl: the root `RunConfig`, which only composes the sections.

Each component owns one section, defined in a module of its own (`policy.py`, `tasks.py`, `sft.py`,
`rollout.py`, `store.py`, `sandbox.py`, `gateway.py`, `learner.py`, `cluster.py`); the loop's, the
evaluation's, logging's and distillation's small sections live here beside the root, and every section
is importable from here. Every field has a default, bounds where they apply and a one-line docstring
(shown by `asyncrl ... --dry-run` and in error messages). Three sections have choices, `rollout.type`,
`store.type` and `sandbox.backend`: each is a union of one model per choice over a base holding what
they share, discriminated by that key, so a field of another choice is an unknown key. These modules
import pydantic and the standard library only, so any process can validate a config without pulling
in torch or Ray.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .cluster import ClusterConfig
from .gateway import GatewayConfig
from .learner import LearnerConfig, OptimizerConfig
from .policy import MTPConfig, PolicyConfig, TinyModelConfig
from .rollout import EmbeddedRolloutConfig, RolloutBase, RolloutConfig, SamplingConfig, VLLMRolloutConfig
from .sandbox import DockerSandboxConfig, ProcessSandboxConfig, SandboxBase, SandboxConfig
from .section import Section
from .sft import IndexerWarmupConfig, SFTConfig, SFTDataConfig
from .store import RedisStoreConfig, SQLiteStoreConfig, StoreBase, StoreConfig
from .tasks import (
    AgenticTaskConfig,
    ArithmeticTaskConfig,
    GeneralTaskConfig,
    HTTPRewardConfig,
    JudgeRewardConfig,
    RewardsConfig,
    TasksConfig,
    TaskSpec,
)

__all__ = [
    "AgenticTaskConfig",
    "ArithmeticTaskConfig",
    "ClusterConfig",
    "DistillConfig",
    "DockerSandboxConfig",
    "EmbeddedRolloutConfig",
    "EvalConfig",
    "GatewayConfig",
    "GeneralTaskConfig",
    "HTTPRewardConfig",
    "IndexerWarmupConfig",
    "JudgeRewardConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LoopConfig",
    "MTPConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "ProcessSandboxConfig",
    "RedisStoreConfig",
    "RewardsConfig",
    "RolloutBase",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SQLiteStoreConfig",
    "SamplingConfig",
    "SandboxBase",
    "SandboxConfig",
    "StoreBase",
    "StoreConfig",
    "TaskSpec",
    "TasksConfig",
    "TeacherSpec",
    "TinyModelConfig",
    "VLLMRolloutConfig",
]


class EvalConfig(Section):
    """Held-out evaluation (greedy exact match)."""

    num_problems: int = Field(500, ge=1, le=100000)
    """Held-out problems per evaluation."""
    max_tokens: int = Field(16, ge=1)
    """Token budget of each answer."""
    seed: int = 1234
    """Seed of the held-out problem draw (fixed so evaluations are comparable)."""
    engine: Literal["shared", "own"] = "shared"
    """Where the run's periodic evaluations play (`sched/evaluation.py`): `shared`, on the serving engines
    between pushes (training waits: fine where evaluation takes a second); `own`, on one more engine that
    loads each evaluated push and plays beside training (it asks for no CPU of its own, and a GPU where the
    engines use them), the first evaluation included. The final one, after the RL phase, plays on the serving
    engines unless the last push's is already playing there."""


class LoggingConfig(Section):
    """Where metrics go."""

    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes under the run directory with no network."""
    wandb_project: str = "asyncrl"
    """wandb project name."""
    progress: bool = True
    """Show progress bars and live displays."""


class LoopConfig(Section):
    """The scheduler's loop (`asyncrl run`): how episodes are admitted and how long the run lasts."""

    mode: Literal["async", "sync"] = "async"
    """async: generation keeps running while the learner trains; sync: generate a batch, train, push, repeat."""
    steps: int = Field(200, ge=1)
    """Optimizer steps of the whole run (a resumed run continues until the learner's version reaches this)."""
    max_inflight: int = Field(512, ge=1)
    """Most episodes running at once (async); a GRPO group is admitted whole, so at least learner.group_size."""
    episode_max_tokens: int = Field(16, ge=1)
    """Answer budget of each training episode, in tokens (episodes sample at rollout.sampling.temperature)."""
    episode_timeout_s: float = Field(60.0, gt=0)
    """An episode running longer ends with status timeout."""
    eval_every: int = Field(20, ge=1)
    """Held-out evaluation (eval.num_problems, greedy) every this many pushed policy versions."""
    eval_every_s: float | None = Field(None, gt=0)
    """Also evaluate once this many seconds of the run have passed since the last evaluation began, at the
    next push (None: by versions only). Whichever of the two comes first; a cadence in wall time is what
    `asyncrl bench learn` compares sides at."""
    wall_budget_s: float | None = Field(None, gt=0)
    """Stop the RL loop after this many seconds even if `steps` is not reached (None: no limit)."""
    max_batches_without_step: int = Field(1000, ge=0)
    """Stop the run when this many batches in a row took no optimizer step because in every group the
    rewards were equal (no rollout had an advantage): the policy learns nothing from its tasks, and the
    run exits with status 1 saying so. 0: never stop for that."""
    sft_first: bool | None = None
    """Run the SFT warm start first and start RL from its checkpoint: None (default) when policy.path is unset
    (the tiny policy learns its tasks' formats there); true also from a policy.path (a pretrained model that
    must first learn a format, e.g. a tool-call syntax: configs/smollm2_agentic.yaml); false never."""
    episode_transport: Literal["inprocess", "http"] = "inprocess"
    """How the episodes this process plays reach the gateway it hosts: inprocess hands each request to the
    gateway's app on the same event loop (no socket; the same routes and recording code); http goes over
    loopback as an outside agent's would (gateway/serving.py). Outside agents use the port either way."""
    record_batches: bool = True
    """Write what each learner step trained (its rollout ids in order, a few hundred bytes: batches/step-N.json),
    so `asyncrl replay train` can re-run any step and `asyncrl replay score --step N` can select its rollouts."""


class TeacherSpec(Section):
    """One teacher of cross-stage distillation: an earlier stage's final checkpoint (or a gateway serving
    it) and its share of prompts."""

    checkpoint: str | None = None
    """The stage's final checkpoint (a Hugging Face directory), scored by a teacher actor of this run; or set url."""
    url: str | None = None
    """Base URL of a gateway serving the stage's final checkpoint (`asyncrl serve`), e.g. http://127.0.0.1:8000;
    the teacher is scored through its POST /v1/tokens/score. Exactly one of checkpoint and url."""
    token_env: str | None = None
    """Environment variable holding the run token of the gateway serving this url teacher (`asyncrl token RUN`)."""
    ratio: float = Field(1.0, gt=0.0, le=1e6)
    """Relative share of the student's prompts drawn from this stage's task (shares are ratio / sum of ratios)."""

    @model_validator(mode="after")
    def _check_source(self) -> TeacherSpec:
        if self.checkpoint and self.url:
            raise ValueError("a teacher is a checkpoint or a url, not both: set checkpoint: PATH or url: http://HOST:PORT")
        if not self.checkpoint and not self.url:
            raise ValueError("a teacher needs its stage's checkpoint (checkpoint: PATH) or a gateway serving it (url: http://HOST:PORT)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"teacher url must start with http:// or https://, got {self.url!r}")
        return self


class DistillConfig(Section):
    """On-policy cross-stage distillation (`asyncrl distill`, distill/): the student (policy.path) samples
    prompts of each earlier stage and learns from that stage's final checkpoint, token by token."""

    teachers: dict[str, TeacherSpec] = {}
    """Stage name -> its teacher; the name is the stage's task (an entry of tasks.mix, or a built-in environment
    name); empty: no distillation."""
    cpus_per_teacher: float = Field(0.5, gt=0.0)
    """Ray CPU resources of each teacher's scoring actor (fractions allowed)."""
    gpus_per_teacher: float = Field(0.0, ge=0.0)
    """Ray GPU resources of each teacher's scoring actor; 0 on CPU machines (with a GPU the teacher scores on it)."""
    torch_threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads inside each teacher actor."""
    max_batch_tokens: int = Field(8192, ge=1)
    """Most padded tokens (rows x longest) in one teacher scoring forward; bounds its memory."""

    @model_validator(mode="after")
    def _check_names(self) -> DistillConfig:
        for name in self.teachers:
            if not name or not all(c.isalnum() or c in "_.-" for c in name):
                raise ValueError(f"teacher name {name!r} must be letters, digits, '_', '.' or '-'")
        return self


class RunConfig(Section):
    """A whole asyncrl job. Presets live beside this module as YAML files."""

    name: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name; the run directory is <runs_dir>/<name>."""
    runs_dir: str = "runs"
    """Folder that holds run directories."""
    seed: int = 0
    """Global seed."""
    torch_threads: int = Field(2, ge=1, le=256)
    """torch intra-op threads in the driver process (SFT, evaluation)."""
    policy: PolicyConfig = PolicyConfig()
    """The model being trained."""
    tasks: TasksConfig = TasksConfig()
    """The built-in tasks' settings and the task mix."""
    rewards: RewardsConfig = RewardsConfig()
    """The reward plug-ins that call a service."""
    sft: SFTConfig = SFTConfig()
    """The supervised warm start."""
    rollout: RolloutConfig = EmbeddedRolloutConfig()
    """The rollout engines; `type` picks embedded or vllm."""
    store: StoreConfig = SQLiteStoreConfig()
    """The trajectory store; `type` picks sqlite or redis."""
    gateway: GatewayConfig = GatewayConfig()
    """The TITO gateway."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics and progress output."""
    learner: LearnerConfig = LearnerConfig()
    """The RL learner."""
    loop: LoopConfig = LoopConfig()
    """The scheduler's loop of `asyncrl run`."""
    sandbox: SandboxConfig = ProcessSandboxConfig()
    """Where tool code runs; `backend` picks process or docker."""
    distill: DistillConfig = DistillConfig()
    """Cross-stage distillation."""
    cluster: ClusterConfig = ClusterConfig()
    """The Ray the actors run in (local by default) and where on it they go."""

    @property
    def sft_warm_start(self) -> bool:
        """Whether `asyncrl run` trains the SFT warm start before RL (`loop.sft_first`)."""
        return self.policy.path is None if self.loop.sft_first is None else self.loop.sft_first

    @model_validator(mode="after")
    def _check_loop(self) -> RunConfig:
        if self.loop.max_inflight < self.learner.group_size:
            raise ValueError("loop.max_inflight must be at least learner.group_size (groups are admitted whole)")
        if self.distill.teachers and self.learner.group_size != 1:
            raise ValueError("distillation trains on single rollouts: set learner.group_size to 1 (it has no groups)")
        if self.sft.task is not None and self.sft.task not in self.tasks.mix:
            known = ", ".join(self.tasks.mix) or "none"
            raise ValueError(f"sft.task {self.sft.task!r} is not a task of tasks.mix (its tasks: {known})")
        if not self.cluster.is_local and self.store.type == "sqlite":
            raise ValueError(
                f"cluster.address {self.cluster.address!r} needs store.type redis: an SQLite store is a file on one machine's "
                "disk, which gateways and processes on other nodes cannot share (store: {type: redis, url: redis://HOST:6379/0})"
            )
        return self
