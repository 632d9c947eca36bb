"""SmolLM2-135M-Instruct in the embedded engine on its defaults (EmbeddedRolloutConfig(): no max_model_len,
rollout.kv_cache_memory a quarter of the memory available, 64 running requests) with 256 chat requests in
flight at once, each 64 new tokens (issue 36: the dense cache was killed for memory at 23.7 GB here). Prints
the cache's blocks, the peak RSS, preemptions and throughput:

    asyncrl model fetch smollm2-135m && python scripts/flight_memory.py
"""

import asyncio
import resource
import time

from transformers import AutoTokenizer

from asyncrl.configs.models import resolve_model_path
from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import SamplingParams
from asyncrl.rollout import EmbeddedEngine

IN_FLIGHT, NEW_TOKENS = 256, 64


async def main() -> None:
    path = resolve_model_path("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = EmbeddedEngine.from_pretrained(path, EmbeddedRolloutConfig())
    health = engine.health()
    print(f"cache: {health['kv_blocks']} blocks of {engine.cache.block_size} positions ({engine.cache.bytes / 1e9:.2f} GB), "
          f"max_model_len {engine.max_model_len}")  # fmt: skip
    questions = [[{"role": "user", "content": f"Question {i}: name a prime number above {10 * i}."}] for i in range(IN_FLIGHT)]
    texts = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) for messages in questions]
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(engine.generate(p, SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=i)) for i, p in enumerate(prompts))
    )
    took = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    health = engine.health()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{IN_FLIGHT} requests in flight: {tokens} tokens in {took:.1f} s ({tokens / took:.0f} tok/s), peak RSS {peak:.0f} MiB, "
          f"preemptions {health['preemptions']}, prefill tokens {health['prefill_tokens']} "
          f"(prompts {sum(map(len, prompts))}), errors {sum(r.finish_reason == 'error' for r in results)}")  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
