"""A small modern GPT, in one file, read top to bottom.

Same shape as the Llama family of decoder-only transformers, at toy scale:
RMSNorm instead of LayerNorm, rotary position embeddings (RoPE) instead of a learned
position table, a SwiGLU MLP, no biases, pre-norm residual blocks, tied input/output
embeddings. Field names follow Hugging Face's `LlamaConfig`, so what you learn here
transfers to reading real model configs.

Run it directly for a smoke test:  python snippets/models/gpt.py
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# --8<-- [start:config]
class ConfigError(ValueError):
    """A model config that cannot be built; the message says which field and how to fix it."""


ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

# People arriving from nanoGPT type these; point them at the Hugging Face name instead.
_NANOGPT_NAMES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "block_size": "max_position_embeddings",
}


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level: every UTF-8 byte is a token, no tokenizer needed
    hidden_size: int = 64
    intermediate_size: int = 172  # SwiGLU width, about 8/3 * hidden_size (see CONFIGS)
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 64  # context length: the longest sequence the model accepts
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    attn_implementation: str = "sdpa"  # "sdpa" (fused kernel) or "eager" (written out)
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        # Fail here, with the fix in the message, rather than as a shape error deep in forward.
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer; "
                                  f"set {name} to a whole number such as 64")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive number; "
                                  f"the usual value is {getattr(GPTConfig, name)!r}")
        for name in ("tie_word_embeddings", "gradient_checkpointing"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be true or false")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"attn_implementation={self.attn_implementation!r} is not supported; "
                f"use one of {', '.join(repr(a) for a in ATTN_IMPLEMENTATIONS)}")
        heads = self.num_attention_heads
        # Suggest the two nearest hidden sizes that make head_dim a whole, even number.
        step = 2 * heads
        below = (self.hidden_size // step) * step
        nearby = " or ".join(str(h) for h in (below, below + step) if h > 0)
        if self.hidden_size % heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{heads}: head_dim must be an integer; choose hidden_size as a multiple of "
                f"num_attention_heads (e.g. {nearby}, which also keep head_dim even for RoPE)")
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim = hidden_size / num_attention_heads = {self.hidden_size}/{heads} = "
                f"{self.head_dim} is odd: RoPE rotates dimensions in pairs, so head_dim must "
                f"be even; choose hidden_size as a multiple of 2*num_attention_heads={step} "
                f"(e.g. {nearby}) or change num_attention_heads")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> GPTConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {str(path)!r}; check the path") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON ({err}); fix the file") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object like {{\"hidden_size\": 64}}")
        valid = [f.name for f in fields(cls)]
        for key in data:
            if key not in valid:
                guess = _NANOGPT_NAMES.get(key) or next(
                    iter(difflib.get_close_matches(key, valid, n=1)), None)
                hint = f"did you mean {guess!r}? " if guess else ""
                raise ConfigError(f"unknown key {key!r} in {path}; {hint}"
                                  f"valid keys are: {', '.join(valid)}")
        return cls(**data)
# --8<-- [end:config]


# --8<-- [start:named-configs]
# SwiGLU has three matrices where GPT-2's GELU MLP has two, so Llama sets intermediate_size to
# about 8/3 * hidden_size, rounded up to a hardware-friendly multiple (256 in Llama: 11008 for
# 4096), to keep the MLP's parameter count near GPT-2's 4x two-matrix MLP.
CONFIGS = {
    # Trains in well under a minute on a laptop CPU.
    "tiny": GPTConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64),
    # About 0.8M parameters: the learning guide's --model-size small.
    "small": GPTConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=128),
    # About 4.8M parameters; still runs 50 steps on 2 CPU processes in a couple of minutes.
    "medium": GPTConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                        num_attention_heads=8, max_position_embeddings=256),
    # GPT-2 small's shape, for memory arithmetic. With GPT-2's intermediate 3072, SwiGLU's
    # third matrix would add 28M parameters (152M); 2048 = 8/3 * 768 gives 123.6M, and
    # without GPT-2's learned position table (RoPE has no parameters) that lands on the
    # familiar 124M class.
    "gpt2-small": GPTConfig(vocab_size=50257, hidden_size=768, intermediate_size=2048,
                            num_hidden_layers=12, num_attention_heads=12,
                            max_position_embeddings=1024),
}


def get_config(name_or_path: str | Path, **overrides) -> GPTConfig:
    """A config by name from CONFIGS, or from a .json file; keyword overrides are applied."""
    if str(name_or_path) in CONFIGS:
        config = CONFIGS[str(name_or_path)]
    elif str(name_or_path).endswith(".json") or Path(name_or_path).is_file():
        config = GPTConfig.from_json(name_or_path)
    else:
        raise ConfigError(f"unknown config {str(name_or_path)!r}; use one of "
                          f"{', '.join(CONFIGS)} or a path to a .json file")
    valid = [f.name for f in fields(GPTConfig)]
    for key in overrides:
        if key not in valid:
            raise ConfigError(f"unknown override {key!r}; valid keys are: {', '.join(valid)}")
    # replace() returns a fresh, re-validated copy, so callers never mutate CONFIGS.
    return replace(config, **overrides)
# --8<-- [end:named-configs]


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned per-channel gain."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares overflows or loses precision in bf16/fp16, so do it in fp32.
        # --8<-- [start:exercise-1]
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return out.to(x.dtype)
        # --8<-- [end:exercise-1]
# --8<-- [end:rmsnorm]


# --8<-- [start:rope]
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    # --8<-- [start:exercise-2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
    # --8<-- [end:exercise-2]


def precompute_rope(head_dim: int, max_positions: int, theta: float = 10000.0):
    """cos and sin tables of shape (max_positions, head_dim) for apply_rotary_pos_emb."""
    # Pair i of the head rotates at frequency theta^(-2i/head_dim): fast pairs resolve nearby
    # positions, slow pairs distant ones.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_positions, head_dim/2)
    # rotate_half pairs dimension i with i + head_dim/2, so both halves share the angle.
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q and k by their position's angles; q.k then depends only on the distance."""
    # --8<-- [start:exercise-3]
    q_rotated = q * cos + rotate_half(q) * sin
    k_rotated = k * cos + rotate_half(k) * sin
    return q_rotated, k_rotated
    # --8<-- [end:exercise-3]
# --8<-- [end:rope]


# --8<-- [start:mlp]
class MLP(nn.Module):
    """SwiGLU: a SiLU-activated gate multiplies a second projection before projecting back."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.down_proj.is_residual_output = True  # see GPT._init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --8<-- [start:exercise-4]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # --8<-- [end:exercise-4]
# --8<-- [end:mlp]


# --8<-- [start:attention]
class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.attn_implementation = config.attn_implementation
        h = config.hidden_size
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.o_proj.is_residual_output = True  # see GPT._init_weights
        cos, sin = precompute_rope(self.head_dim, config.max_position_embeddings,
                                   config.rope_theta)
        # Buffers follow .to(device); persistent=False keeps these derived tables out of
        # checkpoints, since they are recomputed from the config.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 instead of num_heads: under tensor parallelism each rank holds only some heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos = self.rope_cos[:T].to(q.dtype)
        sin = self.rope_sin[:T].to(q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.attn_implementation == "sdpa":
            # One fused kernel (flash or memory-efficient where available): the T x T score
            # matrix is never materialised in memory.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # --8<-- [start:exercise-5]
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, heads, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))  # no peeking at the future
            # exp() of large scores overflows in half precision; softmax in fp32.
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            y = probs @ v
            # --8<-- [end:exercise-5]
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads back side by side
        return self.o_proj(y)
# --8<-- [end:attention]


# --8<-- [start:block]
class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CausalSelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm: the residual stream x is never normalised, so gradients reach early
        # layers through a clean sum of identities.
        x = x + self.self_attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x
# --8<-- [end:block]


# --8<-- [start:gpt]
def shift_for_next_token(tokens: torch.Tensor):
    """Split (B, T+1) tokens into inputs (B, T) and targets (B, T): targets[:, t] is the
    token that follows inputs[:, t]."""
    return tokens[:, :-1], tokens[:, 1:]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            # One matrix maps token -> vector and vector -> token scores; saves vocab*hidden
            # parameters (38.6M of gpt2-small's 124M).
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # --8<-- [start:exercise-6]
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "is_residual_output", False):
                # Each block adds two outputs (attention, MLP) to the residual stream; the
                # variance of the sum grows with 2 * num_hidden_layers, so shrink each
                # added term's std by its square root to keep the stream's scale at init.
                std = std / math.sqrt(2 * self.config.num_hidden_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        # --8<-- [end:exercise-6]

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        """input_ids: (B, T) token ids. targets: (B, T) or None, the *next* token at each
        position, already shifted by the caller: for a batch of tokens (B, T+1),
        input_ids = tokens[:, :-1] and targets = tokens[:, 1:] (see shift_for_next_token).
        Positions whose target is -100 are ignored in the loss.

        Returns (logits, loss): logits (B, T, vocab_size); loss is the mean cross-entropy,
        or None when targets is None."""
        T = input_ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise ValueError(
                f"input has {T} tokens but max_position_embeddings="
                f"{self.config.max_position_embeddings}; crop the input to the last "
                f"{self.config.max_position_embeddings} tokens (generate() does) or use a "
                f"config with a larger max_position_embeddings")
        # --8<-- [start:exercise-7]
        x = self.embed_tokens(input_ids)  # (B, T, hidden)
        for block in self.layers:
            if self.config.gradient_checkpointing and self.training:
                # Keep only each block's input; its inner activations are recomputed during
                # backward. Costs about one extra forward, saves most activation memory.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.norm(x)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            # fp32 for the log-softmax over the vocabulary, even when logits are bf16.
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                   targets.reshape(-1), ignore_index=-100)
        return logits, loss
        # --8<-- [end:exercise-7]

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (a tied lm_head counted once). exclude_embeddings drops the
        token-embedding table (and an untied lm_head), as in scaling-law papers."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields tied ones once
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
            if not self.config.tie_word_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to input_ids (B, T); temperature=0 is greedy.
        Call model.eval() first."""
        for _ in range(max_new_tokens):
            # The model only knows max_position_embeddings positions: keep the most recent.
            context = input_ids[:, -self.config.max_position_embeddings:]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
            input_ids = torch.cat((input_ids, next_id), dim=1)
        return input_ids
# --8<-- [end:gpt]


# --8<-- [start:main]
if __name__ == "__main__":
    torch.manual_seed(0)
    config = get_config("tiny")
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17))  # 16 inputs + 1 for the shift
    input_ids, targets = shift_for_next_token(tokens)
    logits, loss = model(input_ids, targets)
    print(f"parameters: {model.num_parameters():,}")
    print(f"logits shape: {logits.shape}")
    print(f"loss: {loss.item():.4f} (an untrained model should be near "
          f"ln({config.vocab_size}) = {math.log(config.vocab_size):.3f})")
# --8<-- [end:main]
