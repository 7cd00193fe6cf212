"""Sampling exactly as ComfyUI's KSampler does it for flow models: noise, sigma schedules, samplers, latent formats."""
