"""The multi-GPU diffusion-transformer engine (the model families in families/); runs and is tested without ComfyUI.

- cli/: the command line (`python -m engine ...`): generate, demo, make-tiny, bench.
- runtime/: the rank runtime: the client (caller's process), rank processes, the shared-memory bridge that every
  tensor crosses, the control channel and the job kinds.
- generate/: the typed generate request (validated and plan-resolved on the client, rebuilt on the ranks) and
  its run on a rank.
- parallel/: the plan (resolved and validated in plan.py), the rank mesh, sequence-parallel attention, and
  `parallelize`, which applies sequence, CFG and data parallelism to a model per family.
- models/: checkpoints ComfyUI users have, loaded into unmodified diffusers transformers; LoRAs; the flow-model
  view the sampler sees; tiny and synthetic models.
- sampling/: ComfyUI's KSampler for flow models: noise, schedules, samplers, latent formats.
"""
