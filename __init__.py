"""ComfyUI entry point of the xDiT node pack. ComfyUI imports this file by path (the pack's folder may have any
name and is not on sys.path); the nodes live in xdit_nodes/ and call the engine in engine/, which runs (and is
tested) without ComfyUI."""

# The frontend extension (xdit_nodes/web/*.js): ComfyUI reads WEB_DIRECTORY from this module for V1 and V3 packs alike
WEB_DIRECTORY = "./xdit_nodes/web"


async def comfy_entrypoint():
    from .xdit_nodes.nodes import XDiTExtension  # imports comfy_api: only inside ComfyUI
    return XDiTExtension()
