"""Peak RSS and wall time of one 20,000-token prefill on the agent policy's shape (tests/agent_policy.py) at
a given rollout.prefill_chunk_tokens; run each setting in its own process (peak RSS is per process):

    for c in 1048576 4096; do python scripts/prefill_memory.py $c; done
"""

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agent_policy import build_model, build_tokenizer

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import SamplingParams
from asyncrl.rollout import EmbeddedEngine

PROMPT_TOKENS = 20_000


def main(chunk: int) -> None:
    model = build_model(build_tokenizer())
    config = EmbeddedRolloutConfig(max_num_seqs=1, torch_threads=1, prefill_chunk_tokens=chunk)
    engine = EmbeddedEngine(model, config)
    prompt = [(i * 7919) % 16000 + 10 for i in range(PROMPT_TOKENS)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"prefill_chunk_tokens {chunk}: peak RSS {peak:.0f} MiB (before the request {before:.0f} MiB), {took:.1f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
