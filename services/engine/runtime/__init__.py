"""Running the model: the runner and its execution plan (measured by tune.py), the model code (models/), the
sampler and grammar masks, LoRA adapters, KV transfer for the shared cache, model versions for hot swaps."""
