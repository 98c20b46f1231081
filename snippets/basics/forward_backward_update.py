"""A training step is three moves: forward (compute the loss), backward (fill every p.grad),
update (move every p against its gradient). Checked here against the update rule by hand."""

import torch

torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
x, target = torch.randn(8, 3), torch.randn(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

for step in range(3):
    loss = torch.nn.functional.mse_loss(model(x), target)  # 1. forward
    optimizer.zero_grad()  # gradients accumulate by default: clear last step's
    loss.backward()  # 2. backward: fills p.grad for every parameter
    before = model.weight.detach().clone()
    optimizer.step()  # 3. update: p -= lr * p.grad
    by_hand = before - 0.1 * model.weight.grad
    # allclose, not equal: the optimizer's fused multiply-add rounds once where by_hand rounds twice
    print(f"step {step}: loss {loss.item():.4f}, "
          f"weight == weight - lr * grad: {torch.allclose(model.weight, by_hand)}")
