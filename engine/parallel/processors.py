"""Attention processors for sequence parallelism, set on an unmodified diffusers transformer through its
processor interface. They compute what diffusers' FluxAttnProcessor / JointAttnProcessor2_0 compute, with
the attention itself going through the sequence-parallel entry point. Text tokens are either sharded with
the image tokens (FLUX, when their count divides the degree) or held in full by every rank (joint): the token hooks
say which per forward through diffusers' own `joint_attention_kwargs` (`joint_text_tokens`, 0 when split). FLUX.1
Kontext reference tokens, at the end of the image tokens, are split or joint the same way (`joint_reference_tokens`)."""
from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .attention import SequenceParallelAttention


class FluxSPProcessor:
    def __init__(self, attention: SequenceParallelAttention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 joint_text_tokens: int = 0, joint_reference_tokens: int = 0):
        """joint_text_tokens: the text tokens every rank holds in full, at the front of a single block's sequence
        (0: the text is split with the image tokens); joint_reference_tokens: the reference tokens every rank holds
        in full, at the end of the sequence (0: none, or split with the image tokens)."""
        if attention_mask is not None:
            raise ValueError("sequence-parallel FLUX attention takes no attention mask")
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(-1, (-1, attn.head_dim))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:  # the model computed it from this rank's (sliced) position ids
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        if joint_text_tokens or joint_reference_tokens:
            # the sequence is [text | image shard | references]: the joint ones enter the attention together
            n, end = joint_text_tokens, q.shape[1] - joint_reference_tokens
            joint = tuple(torch.cat([t[:, :n], t[:, end:]], dim=1) for t in (q, k, v))
            image, held = self.attention(q[:, n:end], k[:, n:end], v[:, n:end], joint=joint)
            out = torch.cat([held[:, :n], image, held[:, n:]], dim=1)
        else:
            out, _ = self.attention(q, k, v)
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        n = encoder_hidden_states.shape[1]
        text_out, image_out = out[:, :n], out[:, n:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


class SD3SPProcessor:
    """SD3/SD3.5 joint attention (image tokens sharded, the 77+N text tokens joint) and SD3.5's image-only attn2."""

    def __init__(self, attention: SequenceParallelAttention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        """SD3's text tokens arrive separately (encoder_hidden_states) and are always joint."""
        if attention_mask is not None:
            raise ValueError("sequence-parallel SD3 attention takes no attention mask")
        q, k, v = (proj(hidden_states) for proj in (attn.to_q, attn.to_k, attn.to_v))
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (t.unflatten(-1, (attn.heads, head_dim)) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        joint = None
        if encoder_hidden_states is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(-1, (attn.heads, head_dim))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            joint = (eq, ek, ev)
        image, text = self.attention(q, k, v, joint=joint)
        image = attn.to_out[1](attn.to_out[0](image.flatten(2, 3).to(q.dtype)))
        if encoder_hidden_states is None:
            return image
        text = text.flatten(2, 3).to(q.dtype)
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return image, text
