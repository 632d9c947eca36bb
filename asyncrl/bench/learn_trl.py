"""`asyncrl bench learn`'s TRL side: GRPOTrainer on the same checkpoint, task, batch and budget.

The checkpoint is a Hugging Face directory (model, tokenizer, chat template), so TRL loads it as any
user's model. The settings mirror the asyncrl config: `learner.group_size` generations per prompt,
`learner.batch_groups` prompts per optimizer step (one generation batch per step, one pass over it),
`rollout.sampling.temperature`, `learner.lr` (constant), `learner.grad_clip`, no KL term,
the task's tokens per reply; the reward is the task's own (`learn_task.py`: the arithmetic check, or a
dataset file's reward plug-in such as math-verify). Held-out accuracy is greedy generation on the same problems asyncrl
evaluates, every `eval_every_s` seconds of TRL's wall, inside the budget as asyncrl's evaluations are.
TRL runs in this process with a torch thread per CPU (it has the whole machine; asyncrl's actors
take one thread each).
"""

from __future__ import annotations

import os
import random
import tempfile
import time

from asyncrl.configs.schema import RunConfig


class TRLMissing(RuntimeError):
    """TRL is not installed: the side is skipped with this note."""


def run_trl(config: RunConfig, budget_s: float, eval_every_s: float) -> dict:
    try:
        import trl
    except ImportError:
        raise TRLMissing('trl is not installed (pip install -e ".[bench]"); the TRL side was skipped') from None
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from .learn import _side
    from .learn_task import BenchTask

    # The whole machine, whatever ran before it here (an embedded engine sets the process's threads to its own).
    torch.set_num_threads(os.cpu_count() or 1)
    path = config.policy.path
    if path is None:
        raise ValueError("the TRL side needs policy.path (a Hugging Face checkpoint directory)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    task = BenchTask(config)
    rng = random.Random(config.seed)
    problems = [task.sample(rng) for _ in range(50_000)]
    heldout = task.heldout(config.eval.num_problems, config.eval.seed)
    dataset = Dataset.from_list([{"prompt": task.messages(problem), "index": i} for i, problem in enumerate(problems)])

    def reward(prompts, completions, index, **_) -> list[float | None]:
        texts = [completion[0]["content"] for completion in completions]
        return [reward for reward, _ in score_all(task, [problems[i] for i in index], texts)]

    learner = config.learner
    batch = learner.group_size * learner.batch_groups
    with tempfile.TemporaryDirectory(prefix="bench-learn-trl-") as output_dir:
        args = trl.GRPOConfig(
            output_dir=output_dir, num_generations=learner.group_size, per_device_train_batch_size=batch,
            max_completion_length=task.max_tokens, temperature=config.rollout.sampling.temperature,
            learning_rate=learner.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=learner.grad_clip, beta=0.0,
            num_iterations=1, use_cpu=True, bf16=False, max_steps=1_000_000, save_strategy="no", report_to="none",
            logging_steps=1_000_000, disable_tqdm=True, seed=config.seed, dataloader_num_workers=0,
        )  # fmt: skip
        clock = _Clock(model, tokenizer, heldout, task, budget_s, eval_every_s, batch, config.loop.steps)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                                  callbacks=[type("BudgetCallback", (TrainerCallback,), {"on_step_end": clock.on_step_end})()])  # fmt: skip
        clock.start()
        cpu_before = time.process_time()
        trainer.train()
        cpu = time.process_time() - cpu_before
    trained = clock.steps * clock.samples_per_step
    return _side(clock.curve, trained=trained, wall_s=clock.elapsed(), optimizer_steps=clock.steps, cpu_s={"trl": round(cpu, 2)},
                 extra={"trl_version": trl.__version__, "torch_threads": torch.get_num_threads()})  # fmt: skip


class _Clock:
    """TRL's wall budget and evaluation cadence, as a trainer callback; `max_steps` (loop.steps) ends it
    by count as asyncrl's side ends at loop.steps versions, whichever of the two comes first."""

    def __init__(self, model, tokenizer, heldout, task, budget_s, eval_every_s, samples_per_step, max_steps) -> None:
        self.model, self.tokenizer, self.heldout, self.task = model, tokenizer, heldout, task
        self.budget_s, self.eval_every_s, self.samples_per_step, self.max_steps = budget_s, eval_every_s, samples_per_step, max_steps
        self.curve: list[tuple] = []
        self.steps = 0

    def start(self) -> None:
        accuracy = self.evaluate()
        self.began = time.monotonic()  # training starts after the first evaluation, as asyncrl's RL phase
        self.curve.append((0.0, 0, accuracy))
        self.last_eval = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def on_step_end(self, args, state, control, **_):
        self.steps = state.global_step
        elapsed = self.elapsed()
        done = elapsed >= self.budget_s or self.steps >= self.max_steps  # the clock read once: the last step always closes the curve
        if done or elapsed - self.last_eval >= self.eval_every_s:
            accuracy = self.evaluate()
            # Timed when these weights were the newest, as asyncrl's evaluations are; the cadence counts from its end.
            self.curve.append((round(elapsed, 1), self.steps * self.samples_per_step, accuracy))
            self.last_eval = self.elapsed()
            print(f"trl  step {self.steps:4d}  {elapsed:6.0f}s  held-out {accuracy:.1%}", flush=True)
        if done:
            control.should_training_stop = True
        return control

    def evaluate(self, batch: int = 100) -> float:
        import torch

        self.model.eval()
        tokenizer, correct = self.tokenizer, 0
        tokenizer.padding_side = "left"
        with torch.inference_mode():
            for i in range(0, len(self.heldout), batch):
                problems = self.heldout[i : i + batch]
                messages = [self.task.messages(p) for p in problems]
                texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
                inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = self.model.generate(
                    **inputs, max_new_tokens=self.task.max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
                answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
                correct += sum(ok for _, ok in score_all(self.task, problems, answers))
        self.model.train()
        return correct / len(self.heldout)


def score_all(task, problems: list, texts: list[str]) -> list[tuple[float, bool]]:
    """The task's (reward, correct) of each reply; TRL calls its reward functions outside any event loop."""
    import asyncio

    async def scored():
        return await asyncio.gather(*(task.score(problem, text) for problem, text in zip(problems, texts, strict=True)))

    return list(asyncio.run(scored()))
