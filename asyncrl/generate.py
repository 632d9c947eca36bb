"""`asyncrl generate`: sample from a checkpoint with the embedded engine, for people and for debugging.

Shows exactly what a rollout would record: the token ids, the log-prob each token was sampled with,
and the policy version that produced it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rich.console import Console
from rich.table import Table

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import GenerationResult, RequestError, SamplingParams
from asyncrl.rollout import EmbeddedEngine


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.token_ids is not None:
        try:
            return [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise RequestError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}") from None
    if args.raw is not None:
        return tokenizer(args.raw, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": args.prompt or ""}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


async def _sample(engine: EmbeddedEngine, prompt: list[int], args: argparse.Namespace) -> list[GenerationResult]:
    base = args.seed
    requests = [
        engine.generate(
            prompt,
            SamplingParams(
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_tokens=args.max_tokens,
                seed=None if base is None else base + i,
            ),
        )
        for i in range(args.num_samples)
    ]
    return list(await asyncio.gather(*requests))


def _token_table(result: GenerationResult, tokenizer) -> Table:
    table = Table("#", "id", "text", "log-prob", "version")
    for i, (token, logprob, version) in enumerate(zip(result.token_ids, result.logprobs, result.versions, strict=True)):
        table.add_row(str(i), str(token), repr(tokenizer.decode([token])), f"{logprob:.4f}", str(version))
    return table


def generate_from_checkpoint(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    console = Console()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    # One call, no later turns: no slots kept for prefix reuse (a real model's context is then 0.4 GB a slot, not 48 GB).
    rollout = EmbeddedRolloutConfig(max_num_seqs=max(1, args.num_samples))
    engine = EmbeddedEngine.from_pretrained(args.checkpoint, rollout)
    try:
        prompt = _prompt_ids(args, tokenizer)
        results = asyncio.run(_sample(engine, prompt, args))
    except RequestError as err:
        print(f"asyncrl generate: {err}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    if not args.json:
        console.print(f"[bold]prompt[/bold] ({len(prompt)} tokens): {tokenizer.decode(prompt)!r}")
    for i, result in enumerate(results):
        text = tokenizer.decode(result.token_ids)
        if args.json:
            print(
                json.dumps(
                    {
                        "sample": i,
                        "text": text,
                        "prompt_token_ids": prompt,
                        "token_ids": result.token_ids,
                        "logprobs": result.logprobs,
                        "versions": result.versions,
                        "finish_reason": result.finish_reason,
                    }
                )
            )
            continue
        console.print(f"[bold]sample {i}[/bold] [{result.finish_reason}, {len(result.token_ids)} tokens]: {text!r}")
        if args.tokens:
            console.print(_token_table(result, tokenizer))
    return 0
