"""What a model's shapes count (`ModelConfig`'s parameter counts, chapters 01 and 02): every
matrix, bias, norm and embedding, the experts' share and what one token runs through. Plain
arithmetic on the config's fields, so the count needs no weights; the model built on the meta
device must hold exactly as many (tests/test_config.py, tests/test_experts_sizing.py). The
families sized but not run count their mixers and MLPs in `kit.config.cache_kinds_counts`."""
from __future__ import annotations

import kit.config.cache_kinds_counts as sized


class ParameterCounts:
    """Counting methods `ModelConfig` inherits (they read its fields and per-layer methods)."""

    def attention_weights(self, layer: int = 0) -> int:
        """Elements of layer `layer`'s Q, K, V and O projections (no K or V where it reads
        another layer's cache, no V where V is K's); a family sized only: its mixer's matrices."""
        if self.parts.sized_only:
            return sized.mixer_weights(self, layer)
        d = self.layer_head_dim(layer)
        h, q, kv = self.hidden_size, self.num_attention_heads * d, self.layer_kv_heads(layer) * d
        return h * q + (self.has_kv_cache(layer) + self.has_v_proj(layer)) * h * kv + q * h

    def expert_weights(self) -> int:
        """Elements of one expert's three matrices (gate, up, down)."""
        if self.parts.sized_only:
            return sized.expert_weights(self)
        return 3 * self.hidden_size * self.moe_intermediate_size

    def expert_elements(self) -> int:
        """Elements of one expert: its matrices, and gpt-oss's biases (gate and up 2·I, down
        H): what an expert no token picked leaves unread."""
        return self.expert_weights() + self.parts.expert_bias * (
            2 * self.moe_intermediate_size + self.hidden_size)

    def mlp_weights(self, layer: int, active: bool = False) -> int:
        """Elements of layer `layer`'s MLP matrices: the dense MLP's three, or the router,
        every expert (`active`: only the num_experts_per_tok experts one token runs) and a
        shared expert's three (Llama 4)."""
        if self.parts.sized_only:
            return sized.mlp_weights(self, layer, active)
        if not self.is_moe(layer):
            return 3 * self.hidden_size * self.layer_intermediate_size(layer)
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * self.hidden_size * self.shared_expert_intermediate_size  # Llama 4's
        dense = 3 * self.hidden_size * self.layer_intermediate_size(layer) \
            if self.parts.gemma4 else 0  # Gemma 4's dense MLP beside its experts
        return self.num_experts * self.hidden_size + experts * self.expert_weights() + shared \
            + dense

    def layer_weights(self, layer: int = 0, active: bool = False) -> int:
        """Elements of layer `layer`'s matrices: the Q, K, V and O projections, its MLP's and
        Gemma 4's per-layer input gate and projection."""
        return self.attention_weights(layer) + self.mlp_weights(layer, active) \
            + 2 * self.hidden_size * self.hidden_size_per_layer_input

    def linear_weights(self, active: bool = False) -> int:
        """Elements of every matrix: every layer's, the LM head (the embedding table itself
        when tied) and Gemma 4's projection of the embeddings to every layer's input; `active`:
        only those one token is multiplied by (its experts, not all)."""
        return sum(self.layer_weights(i, active) for i in range(self.num_hidden_layers)) \
            + self.vocab_size * self.hidden_size + self.hidden_size * self.per_layer_width

    def experts_parameters(self) -> int:
        """Elements of every expert of every MoE layer, biases included (the routers not)."""
        return sum(self.num_experts * self.expert_elements()
                   for i in range(self.num_hidden_layers) if self.is_moe(i))

    def active_parameters(self) -> int:
        """Parameters one token runs through: `num_parameters` with each MoE layer's experts
        cut to the k it picks (the routers, attention and embeddings all counted)."""
        unpicked = (self.num_experts - self.num_experts_per_tok) * self.expert_elements()
        return self.num_parameters() - unpicked * sum(map(self.is_moe,
                                                          range(self.num_hidden_layers)))

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (the model's real count must equal it): the
        matrices, the attention biases, every norm, and the input embedding when untied."""
        if self.parts.sized_only:
            return sized.num_parameters(self)
        h = self.hidden_size
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim \
            + h * self.parts.o_bias if self.attention_bias else 0
        embed = 0 if self.tie_word_embeddings else self.vocab_size * h
        norms = sum(len(self.parts.layer_norms) * h + self.layer_head_dim(i) * self.parts.qk_norm
                    * (1 + self.has_kv_cache(i)) for i in range(self.num_hidden_layers))
        sinks = self.num_attention_heads * self.parts.sinks
        return self.linear_weights() + embed + self.experts_biases() + h + norms \
            + self.num_hidden_layers * (bias + sinks) + self.per_layer_parameters() \
            + self.gemma4_router_parameters()

    def gemma4_router_parameters(self) -> int:
        """Gemma 4's MoE layers' vectors: the router's input scale (H) and per-expert scale
        (E), and the three norms around the experts (3 H)."""
        moe = sum(map(self.is_moe, range(self.num_hidden_layers))) if self.parts.gemma4 else 0
        return moe * (4 * self.hidden_size + self.num_experts)

    @property
    def per_layer_width(self) -> int:
        """Gemma 4's per-layer inputs of every layer side by side: layers × their width."""
        return self.num_hidden_layers * self.hidden_size_per_layer_input

    def per_layer_parameters(self) -> int:
        """Gemma 4's per-layer embeddings beside their matrices: the table, the norm of the
        projected inputs and each layer's norm of its projection."""
        if not self.hidden_size_per_layer_input:
            return 0
        return self.vocab_size_per_layer_input * self.per_layer_width \
            + self.hidden_size_per_layer_input + self.num_hidden_layers * self.hidden_size

    def experts_biases(self) -> int:
        """Elements of the routers' and experts' biases (gpt-oss's): per MoE layer one per
        expert (router), and each expert's 2·I + H (gate, up, down)."""
        if not self.parts.expert_bias:
            return 0
        per_layer = self.num_experts * (1 + 2 * self.moe_intermediate_size + self.hidden_size)
        return per_layer * sum(map(self.is_moe, range(self.num_hidden_layers)))
