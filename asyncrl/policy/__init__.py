"""The policy: the tiny model, its tokenizer, the MTP module and checkpoints."""
