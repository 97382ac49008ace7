"""Meshes, logical-axis rules and the tensor-parallel versions of the parallel ops the models call.

A model calls the `ParallelOps` it is given (jlight/core/parallel_ops.py: column_linear,
row_linear, embed, lm_head, expert_ffn); the plain ones are matmuls, and the ShardingPlan here
hands the model tensor-parallel ones that issue the collectives. Nothing in a model file knows the mesh.
"""
