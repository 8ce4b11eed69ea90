"""Gemma 4's per-layer embeddings (`hidden_size_per_layer_input` > 0): besides the token's
embedding, each layer receives a small input of its own, made once per forward and added
into the residual stream at the end of each layer (transformers 5.19's
`Gemma4TextModel.get_per_layer_inputs`, `project_per_layer_inputs` and the decoder layer's
`per_layer_input_gate`; vLLM 0.32's `Gemma4SelfDecoderLayers`):

    table   = embed_tokens_per_layer[token] × sqrt(p)            [layers, p]
    context = norm(per_layer_model_projection(embedding) / sqrt(hidden))   [layers, p]
    inputs  = (context + table) / sqrt(2)

and in layer i: x + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x))
× inputs[i])).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.linear import Linear
from kit.engine.layers.norm import NORMS


class PerLayerInputs(nn.Module):
    """Every layer's input for each token: [tokens, layers, p]."""

    def __init__(self, arch: ModelConfig):
        super().__init__()
        self.layers, self.width = arch.num_hidden_layers, arch.hidden_size_per_layer_input
        self.rows, self.hidden = arch.vocab_size_per_layer_input, arch.hidden_size
        self.embed_tokens_per_layer = nn.Embedding(self.rows, self.layers * self.width)
        self.per_layer_model_projection = Linear(self.hidden, self.layers * self.width,
                                                 bias=False)
        self.per_layer_projection_norm = NORMS[arch.parts.norm](self.width, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        # ids past the table read row 0, as vLLM masks them (transformers would fail)
        ids = torch.where(input_ids < self.rows, input_ids, torch.zeros_like(input_ids))
        table = self.embed_tokens_per_layer(ids)
        table = table * torch.tensor(self.width ** 0.5, dtype=table.dtype)
        context = self.per_layer_model_projection(embeddings) * self.hidden ** -0.5
        context = self.per_layer_projection_norm(context.view(-1, self.layers, self.width))
        return (context + table.view(-1, self.layers, self.width)) * 2.0 ** -0.5


class PerLayerGate(nn.Module):
    """One layer's use of its input: gated by the residual stream, projected back to hidden."""

    def __init__(self, arch: ModelConfig):
        super().__init__()
        h, p = arch.hidden_size, arch.hidden_size_per_layer_input
        self.per_layer_input_gate = Linear(h, p, bias=False)
        self.per_layer_projection = Linear(p, h, bias=False)
        self.post_per_layer_input_norm = NORMS[arch.parts.norm](h, arch.rms_norm_eps)
        self.approximate = "none" if arch.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.per_layer_input_gate(x), approximate=self.approximate)
        return self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))
