"""Meshes, logical-axis rules and the tensor-parallel versions of the parallel ops the models call.

Model code calls `jlight.core.parallel_ops` (column_linear, row_linear, embed, lm_head); with
no mesh active these are plain matmuls, and the ShardingPlan here installs tensor-parallel ones
that issue the collectives. Nothing in a model file knows the mesh.
"""
