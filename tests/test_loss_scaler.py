"""The loss scaler from scratch follows torch.amp.GradScaler step for step, overflows included."""

import math

import torch

from snippets.scratch.precision import DynamicLossScaler

OVERFLOW_STEPS = {3, 4, 9}  # two in a row, then one after some clean steps


def run(use_torch: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    scaler = torch.amp.GradScaler("cpu", **kwargs) if use_torch else DynamicLossScaler(**kwargs)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    scales, stepped = [], []
    for step in range(14):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in OVERFLOW_STEPS:
            loss = loss * math.inf  # injected overflow: every gradient becomes inf or nan
        optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        if use_torch:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            scaler.scale_loss(loss).backward()
            scaler.step(optimizer)
            scales.append(scaler.scale)
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return scales, stepped, [p.detach() for p in model.parameters()]


def test_same_scale_sequence_and_weights_as_grad_scaler():
    ours, theirs = run(use_torch=False), run(use_torch=True)
    assert ours[0] == theirs[0]  # the scale after every step
    assert ours[1] == theirs[1] == [s not in OVERFLOW_STEPS for s in range(14)]
    for a, b in zip(ours[2], theirs[2]):
        # Exact: both multiply each gradient by the same fp32 value 1/scale and run the same SGD.
        assert torch.equal(a, b)
    # 3 clean steps double the scale; each overflow halves it and skips the step.
    assert ours[0][:6] == [1024.0, 1024.0, 2048.0, 1024.0, 512.0, 512.0]


def test_fp16_underflow_is_what_scaling_prevents():
    assert torch.tensor(1e-8).half().item() == 0.0
    assert torch.tensor(1e-8 * 2**16).half().item() > 0
