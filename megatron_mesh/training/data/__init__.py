"""Training data: tokenizer, datasets, documents over the CP ranks, micro-batches, the dataset tool."""
