"""nanoGPT's model architecture, as a yardstick for the course's GPT.

Andrej Karpathy's nanoGPT (github.com/karpathy/nanoGPT, model.py) is the GPT-2 recipe: LayerNorm,
a GELU MLP four times as wide as the model, one `c_attn` matmul for q, k and v together, a learned
position-embedding table, and input and output embeddings tied. This file is that architecture
written again in the course's words (no dropout: nanoGPT's default is 0.0, and the benchmark
trains without it), so that `snippets/bench/fused.py` can time the course's GPT against it at the
same shapes and the same FLOPs per token.

Run it directly for a smoke test:  python snippets/models/nanogpt.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from snippets.models.gpt import GPTConfig


# --8<-- [start:config]
@dataclass
class NanoGPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # context length, the size of the position table
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_hidden: int = 512  # nanoGPT hard-codes 4 * n_embd; here it is set to match FLOPs
    bias: bool = True  # nanoGPT's default: biases in the linear layers and LayerNorms, as GPT-2


def matched_to(config: GPTConfig) -> NanoGPTConfig:
    """The nanoGPT-shaped model with the course config's shapes and FLOPs per token.

    Everything but the MLP carries over: layers, heads, width, context, vocabulary. The MLPs
    differ in shape: SwiGLU multiplies the token by three hidden x intermediate matrices, GELU by
    two hidden x mlp_hidden ones. Equal matmul parameters, 3 * h * f = 2 * h * m, give
    mlp_hidden = 3/2 * intermediate_size (516 for the small config's 344, not 4 * 128 = 512), and
    with them equal FLOPs per token. The position table and the biases add parameters, not
    matmul FLOPs."""
    if config.intermediate_size % 2:
        raise ValueError(f"intermediate_size={config.intermediate_size} is odd: 3/2 of it is "
                         f"not a whole MLP width; use an even intermediate_size")
    return NanoGPTConfig(vocab_size=config.vocab_size,
                         block_size=config.max_position_embeddings,
                         n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
                         n_embd=config.hidden_size, mlp_hidden=3 * config.intermediate_size // 2)


def training_flops_per_token(config: NanoGPTConfig, seq_len: int) -> int:
    """The course's formula (snippets/planner/flops.py) for this architecture: 6 FLOPs per
    matmul parameter per token, plus attention's 12 * n_layer * seq_len * n_embd."""
    n, m = config.n_embd, config.mlp_hidden
    matmul_params = config.n_layer * (4 * n * n + 2 * n * m) + n * config.vocab_size
    return 6 * matmul_params + 12 * config.n_layer * seq_len * n
# --8<-- [end:config]


# --8<-- [start:model]
class SelfAttention(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # learned positions
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # the two residual outputs of each block
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        positions = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-100)
        return logits, loss
# --8<-- [end:model]


if __name__ == "__main__":
    from snippets.models.gpt import get_config
    from snippets.planner import flops

    for name in ("small", "medium"):
        course = get_config(name)
        config = matched_to(course)
        model = NanoGPT(config)
        seq_len = course.max_position_embeddings
        print(f"{name}: mlp_hidden {config.mlp_hidden}, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters, FLOPs per token "
              f"{training_flops_per_token(config, seq_len):,} (course GPT: "
              f"{flops.training_flops_per_token(course, seq_len):,})")
