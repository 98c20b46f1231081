"""Run the MoE of snippets/scratch/moe.py: train the tiny GPT with MoE layers, then split one
layer's experts over 2 processes and compare it with the single-process layer.

    python -m snippets.bench.moe_check   # --steps, --aux-loss-weight, --capacity-factor

tests/test_moe.py runs the same training, and the expert-parallel layer on 2 and 4 ranks.
"""

from __future__ import annotations

import torch

from snippets.data.dataset import RandomWindowSampler, load_tokens
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.moe import (MoE, apply_expert_parallel, moe_aux_loss, moe_layers,
                                  swap_mlps_for_moe)
from snippets.flags import Parser, float_at_least, int_at_least, positive_float
from snippets.machine import set_threads


# --8<-- [start:demo]
def train_moe_gpt(steps: int = 30, num_experts: int = 4, top_k: int = 2,
                  capacity_factor: float | None = 1.25, batch_size: int = 8, seq_len: int = 32,
                  aux_loss_weight: float = 0.01, lr: float = 3e-3, seed: int = 0,
                  log_every: int = 10) -> list[dict]:
    """Train the tiny GPT with MoE MLPs on the course corpus (one process)."""
    torch.manual_seed(seed)
    model = swap_mlps_for_moe(GPT(get_config("tiny")), num_experts, top_k, capacity_factor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    sampler = RandomWindowSampler(load_tokens(None), batch_size, seq_len, seed)
    log = []
    for step in range(1, steps + 1):
        inputs, targets = shift_for_next_token(sampler.next_batch())
        _, lm_loss = model(inputs, targets)
        aux = moe_aux_loss(model)
        (lm_loss + aux_loss_weight * aux).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % log_every == 0:
            routing = [layer.last_routing for layer in moe_layers(model)]
            log.append({
                "step": step, "lm_loss": lm_loss.item(),
                "aux_loss": aux.item() / len(routing),  # mean per layer: 1.0 is balanced
                "dropped": sum(r.dropped for r in routing) / sum(r.assignments for r in routing),
                "tokens_per_expert": [r.tokens_per_expert.tolist() for r in routing],
            })
    return log


def expert_parallel_demo(rank: int, world_size: int) -> dict:
    """One MoE layer, its experts split over the ranks; each rank routes its own tokens."""
    torch.manual_seed(0)  # the same full layer on every rank, then each keeps its experts
    moe = MoE(get_config("tiny"), num_experts=4, top_k=2, capacity_factor=1.0)
    reference = MoE(get_config("tiny"), num_experts=4, top_k=2, capacity_factor=1.0)
    reference.load_state_dict(moe.state_dict())
    apply_expert_parallel(moe)
    x = torch.randn(world_size, 64, 64)[rank]  # this rank's 64 tokens
    y, y_ref = moe(x), reference(x)
    sent = moe.last_routing.tokens_per_expert.view(world_size, -1).sum(dim=1).tolist()
    return {"experts": [moe.first_expert + j for j in range(len(moe.experts))],
            "rows_sent_to_each_rank": sent, "dropped": moe.last_routing.dropped,
            "max_difference": (y - y_ref).abs().max().item()}
# --8<-- [end:demo]


def main(argv=None) -> None:
    parser = Parser(description="Train the tiny GPT with MoE MLPs, then run one MoE layer "
                    "expert-parallel on 2 processes.")
    parser.add_argument("--steps", type=int_at_least(1), default=30)
    parser.add_argument("--aux-loss-weight", type=float_at_least(0), default=0.01)
    parser.add_argument("--capacity-factor", type=positive_float, default=1.25)
    args = parser.parse_args(argv)
    set_threads(1, "a tiny model gains nothing from more")
    print(f"tiny GPT, each MLP replaced by 4 SwiGLU experts, top-2, capacity factor "
          f"{args.capacity_factor}, aux loss weight {args.aux_loss_weight}:")
    for r in train_moe_gpt(args.steps, capacity_factor=args.capacity_factor,
                           aux_loss_weight=args.aux_loss_weight):
        print(f"  step {r['step']:>2}: lm loss {r['lm_loss']:.3f}  aux loss {r['aux_loss']:.3f}"
              f"  dropped {100 * r['dropped']:4.1f}%  tokens per expert {r['tokens_per_expert']}")
    print("\none MoE layer with its 4 experts split over 2 ranks (gloo):")
    for rank, r in enumerate(spawn(expert_parallel_demo, 2, timeout_s=120)):
        print(f"  rank {rank}: holds experts {r['experts']}, sent {r['rows_sent_to_each_rank']} "
              f"rows to ranks 0 and 1, dropped {r['dropped']} assignments, largest difference "
              f"from the single-process layer {r['max_difference']:.1e}")


if __name__ == "__main__":
    main()
