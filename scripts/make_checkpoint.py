"""Write a randomly initialised checkpoint directory of a transformers causal-LM family, for benchmarks that need
a model of a real shape (no model hub is reachable from here): the weights at the shape asked for, and the
embedded tokenizer with its chat template. The vocabulary may be wider than the tokenizer, as real checkpoints
pad theirs (Qwen3: 151,936 rows for 151,669 tokens); only the learner benchmarks' synthetic batches, which draw
ids from the whole vocabulary, use the rows beyond it.

    python scripts/make_checkpoint.py /tmp/qwen3-wide --vocab-size 151936 --hidden-size 256 --layers 4
    asyncrl bench learner policy.path=/tmp/qwen3-wide "bench.ranks=[1]"
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl.policy.tokenizer import build_tokenizer


def write_checkpoint(
    directory: str | Path, family: str = "qwen3", vocab_size: int = 151936, hidden_size: int = 256, layers: int = 4,
    head_dim: int = 64, seed: int = 0,
) -> float:  # fmt: skip
    """Write the checkpoint; returns its parameters in millions. ValueError on a shape that cannot be built."""
    tokenizer = build_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"--vocab-size {vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    if hidden_size % head_dim:
        raise ValueError(f"--hidden-size {hidden_size} is not a multiple of --head-dim {head_dim}")
    heads = hidden_size // head_dim
    config = AutoConfig.for_model(
        family, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, intermediate_size=4 * hidden_size,
        max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return sum(p.numel() for p in model.parameters()) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--family", default="qwen3", help="a transformers model_type (default qwen3)")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        millions = write_checkpoint(args.directory, args.family, args.vocab_size, args.hidden_size, args.layers, args.head_dim, args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(f"{args.directory}: {args.family}, {millions:.1f}M parameters, vocabulary {args.vocab_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
