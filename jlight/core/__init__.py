"""The types every room shares, and nothing else: a leaf that imports only jax and numpy.

errors.py (the errors a user can cause), config.py (ModelConfig), batch_metadata.py (the ragged
batch), quantization.py (quantized weight and KV types), parallel_ops.py (the parallel ops a model
calls, whose mesh versions live in jlight.sharding).
"""
