"""Held-out evaluation: greedy exact-match accuracy on the arithmetic task's held-out split.

Generation is a plain callable from prompt token IDs to completion token IDs, so the same
evaluation runs on whatever serves the policy: the batched Hugging Face greedy decoder below (the
default), the embedded rollout engine, or vLLM. It lives in the learner rather than in `envs/`
because envs talk to models only through clients, while this module drives a torch model directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asyncrl.configs.schema import ArithmeticTaskConfig, EvalConfig
from asyncrl.envs.arithmetic import ArithmeticTask, verify

GenerateFn = Callable[[list[list[int]], int], list[list[int]]]
"""generate(prompts, max_tokens) -> completions: greedy, each completion ends at EOS (kept) or max_tokens."""


@dataclass
class EvalResult:
    accuracy: float
    num_problems: int
    examples: list[dict] = field(default_factory=list)
    """A few (prompt, completion, answer, correct) records, for logs."""


def evaluate_arithmetic(
    generate: GenerateFn, tokenizer, task: ArithmeticTaskConfig, config: EvalConfig, num_examples: int = 4
) -> EvalResult:
    problems = ArithmeticTask(task).heldout_set(config.num_problems, config.seed)
    prompts = [
        tokenizer.apply_chat_template(p.messages(), tokenize=False, add_generation_prompt=True) for p in problems
    ]
    prompt_ids = [tokenizer.encode(text, add_special_tokens=False) for text in prompts]
    completions = [tokenizer.decode(ids) for ids in generate(prompt_ids, config.max_tokens)]
    correct = [verify(text, problem) for text, problem in zip(completions, problems)]
    examples = [
        {"prompt": p.prompt, "completion": c, "answer": p.answer, "correct": ok}
        for p, c, ok in list(zip(problems, completions, correct))[:num_examples]
    ]
    return EvalResult(sum(correct) / len(problems), len(problems), examples)


def engine_greedy_generate(engine) -> GenerateFn:
    """Greedy decoding through a rollout engine (anything with the `Engine` protocol's `generate`).

    All prompts are submitted at once so the engine batches them continuously.
    """
    import asyncio

    from asyncrl.records import SamplingParams

    async def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        results = await asyncio.gather(*(engine.generate(prompt, params) for prompt in prompts))
        return [result.token_ids for result in results]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return asyncio.run(run(prompts, max_tokens))

    return generate


def hf_greedy_generate(model, eos_token_id: int, pad_token_id: int, batch_size: int = 256) -> GenerateFn:
    """Batched greedy decoding with a Hugging Face causal LM and its KV cache.

    Prompts are sorted by length (less padding), left-padded, and given explicit position IDs
    so padding shifts nothing. Finished rows keep decoding pad tokens until the batch is done.
    """

    @torch.no_grad()
    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        was_training = model.training
        model.eval()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            for row, tokens in zip(rows, _greedy_batch(model, [prompts[i] for i in rows], max_tokens)):
                results[row] = tokens
        model.train(was_training)
        return results

    def _greedy_batch(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, longest - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        finished = torch.zeros(len(prompts), dtype=torch.bool)
        generated = []
        for _ in range(max_tokens):
            token = out.logits[:, -1].argmax(-1).masked_fill(finished, pad_token_id)
            generated.append(token)
            finished |= token == eos_token_id
            if finished.all():
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = model(
                input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=position_ids,
                cache=out.cache, use_cache=True,
            )  # fmt: skip
        tokens = torch.stack(generated, dim=1).tolist()
        return [_until_eos(row, eos_token_id) for row in tokens]

    return generate


def _until_eos(tokens: list[int], eos_token_id: int) -> list[int]:
    return tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens
