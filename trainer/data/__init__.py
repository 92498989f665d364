"""Training data: token shards, batches, the prepare/regenerate/inspect verbs, tokenizers and the demo worlds."""
