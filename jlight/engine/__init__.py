"""The engine: scheduler, block manager, model runner, sampler and the loop around them."""
