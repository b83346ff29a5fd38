"""Hugging Face models built from tiny configs (no download), shared by the tests that patch
them whole and the tests that run them as pipelines."""

from __future__ import annotations

from torch import nn
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM


def llama(vocab: int, hidden: int, layers: int, sequence: int, attention: str = "sdpa") -> nn.Module:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: k/v projections narrower than q
        max_position_embeddings=2 * sequence,
        tie_word_embeddings=True,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config)


def bert(vocab: int, hidden: int, layers: int, sequence: int) -> nn.Module:
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=2 * sequence,
        hidden_dropout_prob=0.0,  # dropout would draw different masks in the two models
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",  # an explicit mask tensor (rebuilt on each pipeline stage)
    )
    return BertForMaskedLM(config)


def mamba(vocab: int, hidden: int, layers: int, state_size: int, conv_kernel: int) -> nn.Module:
    config = MambaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        state_size=state_size,
        num_hidden_layers=layers,
        expand=2,
        conv_kernel=conv_kernel,
    )
    return MambaForCausalLM(config)
