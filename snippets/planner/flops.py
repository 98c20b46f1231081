"""Training FLOPs of the course's GPT: the numerator of model FLOPs utilisation (MFU)."""

from snippets.models.gpt import GPTConfig


# --8<-- [start:flops-per-token]
def matmul_params(config: GPTConfig) -> int:
    """Parameters that take part in a matrix multiply per token: every block's projections plus
    the output head. The embedding lookup is a gather, not a matmul, so it does not count."""
    h, f, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    attention = 4 * h * h  # q, k, v, o projections
    mlp = 3 * h * f  # SwiGLU: gate, up, down
    return L * (attention + mlp) + h * config.vocab_size


def training_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """FLOPs to train on one token: forward + backward (2x the forward) = 3 x forward.

    A matmul with N parameters costs 2N FLOPs per token forward (one multiply, one add each), so
    the parameter matmuls cost 3 x 2N = 6N. Attention adds QK^T and probs @ V: 2 x 2 x seq_len x h
    per layer forward for a full (non-causal) score matrix, x3 for training = 12 L T h.
    """
    attention_scores = 12 * config.num_hidden_layers * seq_len * config.hidden_size
    return 6 * matmul_params(config) + attention_scores
# --8<-- [end:flops-per-token]
