"""ComfyUI entry point of the xDiT node pack. ComfyUI imports this file by path; the nodes live in
xdit_nodes/ and call the engine in engine/, which runs (and is tested) without ComfyUI."""
