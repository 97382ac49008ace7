"""Meshes, logical-axis rules and the parallel linear ops the models call.

Model code calls `jlight.sharding.ops` (column_linear, row_linear, embed, lm_head); with
no mesh active these are plain matmuls, under a tensor-parallel mesh they issue the
collectives. Nothing in a model file knows the mesh.
"""
