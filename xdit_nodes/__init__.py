"""ComfyUI nodes: thin translators from CONDITIONING / LATENT / model names to engine jobs. No distributed code."""
