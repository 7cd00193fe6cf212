"""Model loading: the transformer out of the single-file checkpoints ComfyUI users have, no network ever."""
