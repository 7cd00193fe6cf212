"""Parallel methods applied to an unmodified diffusers transformer: the plan and its cost model, the rank mesh,
sequence-parallel attention (Ulysses, Ring, joint text tokens), CFG and data parallel, PipeFusion, the step cache."""
