"""PipeFusion (xDiT's patch-pipelined denoising with stale activations): the planning half (layout.py: patches,
stages, memory, bytes), a stage's share of a family's forward (stage.py, which families build on) and the rank half
(pipeline.py: the stale K/V and the stage loop)."""
