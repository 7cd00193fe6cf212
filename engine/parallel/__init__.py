"""Parallel methods applied to an unmodified diffusers transformer: the rank mesh, sequence-parallel attention
(Ulysses, Ring, joint text tokens), attention processors, CFG and data parallel."""
