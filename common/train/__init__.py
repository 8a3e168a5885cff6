"""The update's machinery: models and adapters, log-probs on packed rows, micro-batches, sequence parallelism,
the optimizer, offload, value heads."""
