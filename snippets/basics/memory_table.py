"""Training memory of the course's named GPT configs: model state by formula (16 bytes per
parameter with AdamW), activations measured on one sequence at full context length."""

import torch

from snippets.models.gpt import CONFIGS, GPT
from snippets.planner.memory import measure_activation_bytes, model_state_bytes

MiB = 2**20
print(f"{'config':<11} {'params':>12} {'model state':>12} {'activations':>12}  per token")
for name, config in CONFIGS.items():
    torch.manual_seed(0)
    model = GPT(config)
    T = config.max_position_embeddings
    tokens = torch.randint(0, config.vocab_size, (1, T + 1))
    activations = measure_activation_bytes(model, tokens[:, :-1], tokens[:, 1:])
    state = model_state_bytes(model.num_parameters(), "fp32")["total"]
    print(f"{name:<11} {model.num_parameters():>12,} {state / MiB:>8.1f} MiB "
          f"{activations / MiB:>8.1f} MiB  {activations / T / 1024:>6.1f} KiB ({T} tokens)")
