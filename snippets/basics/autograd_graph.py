"""The graph autograd records during a forward pass, walked from the loss back to a weight."""

import torch

w = torch.tensor(2.0, requires_grad=True)
b = torch.tensor(0.5, requires_grad=True)
x = torch.tensor(3.0)
y = w * x + b  # forward: each operation records how to differentiate itself
loss = (y - 4.0) ** 2

node = loss.grad_fn  # follow the first input of each node, back to the leaf w
while node is not None:
    print(type(node).__name__)
    node = node.next_functions[0][0] if node.next_functions else None

loss.backward()  # d loss/dw = 2 (wx + b - 4) x = 2 * 2.5 * 3
print(f"w.grad = {w.grad.item()}, b.grad = {b.grad.item()}")
