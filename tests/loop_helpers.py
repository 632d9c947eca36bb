"""What the loop's tests share: a tiny run config and an environment whose random policy has signal."""

from __future__ import annotations

from asyncrl.envs.base import EpisodeResult

TINY = [
    "policy.tiny.arch=qwen3", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=64", "policy.mtp.enabled=false", "loop.sft_first=false",
    "rollout.cpus_per_worker=0.5", "rollout.max_num_seqs=16", "learner.num_cpus=0.5", "learner.group_size=4",
    "learner.batch_groups=2", "learner.lr=1e-2", "learner.checkpoint_every=2", "loop.max_inflight=16",
    "loop.eval_every=2", "eval.num_problems=16", "eval.max_tokens=4", "logging.wandb=disabled", "logging.progress=false",
]  # fmt: skip


class CoinEnv:
    """Rewards the parity of what the policy wrote, so a random policy's groups have signal;
    crashes on every `crash_every`-th task, and raises KeyboardInterrupt (a Ctrl-C) after `stop_after` episodes."""

    name = "coin"

    def __init__(self, crash_every: int = 0, stop_after: int = 0) -> None:
        self.crash_every, self.stop_after, self.episodes = crash_every, stop_after, 0

    def sample_task(self, rng, split="train") -> int:
        return rng.randrange(1_000_000)

    async def run_episode(self, task: int, client) -> EpisodeResult:
        self.episodes += 1
        if self.stop_after and self.episodes == self.stop_after:
            raise KeyboardInterrupt
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": str(task)}], max_tokens=4, temperature=1.0
        )
        if self.crash_every and task % self.crash_every == 0:
            raise RuntimeError("the sandbox died")
        return EpisodeResult(reward=float(sum(map(ord, reply.choices[0].message.content or "")) % 2))
