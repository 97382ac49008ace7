"""How MoE layers may run their routed experts: the values of EngineConfig.moe_impl (--moe-impl)
and Kernels.moe_impl, which models/moe.expert_ffn implements."""

MOE_IMPLS = ("auto", "pallas", "ragged_dot", "gathered", "dense")
