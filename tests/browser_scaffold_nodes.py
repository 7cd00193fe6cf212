"""Test scaffolding for tests/test_browser.py, installed as a node pack in that test's temporary custom_nodes only
(never part of the product): a CONDITIONING of seeded random tensors in FLUX.1's text widths (T5-XXL 4096, CLIP-L
pooled 768, the widths the tiny FLUX model keeps), so a graph queued from the page samples without a text encoder."""
import torch


class RandomFluxConditioning:
    CATEGORY = "testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 512})}}

    def make(self, seed, tokens):
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, tokens, 4096, generator=g)
        return ([[cond, {"pooled_output": torch.randn(1, 768, generator=g), "guidance": 3.5}]],)


NODE_CLASS_MAPPINGS = {"XDiTTestRandomConditioning": RandomFluxConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"XDiTTestRandomConditioning": "Random FLUX Conditioning (test)"}
