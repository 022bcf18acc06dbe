"""Schedules: golden tables at warmup boundaries, decay end points and batch-size changes."""

import math

import pytest
import torch

from flashsgd.optim.schedules import (BatchTable, Schedule, batch_at, decay_factor, epoch_at_step,
                                      lambda_lr, lr_at, lr_at_step, lr_table, scaled_lr,
                                      steps_per_epoch)


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2)  # Goyal et al.: k = 32
    assert scaled_lr(0.2, 100, ref_batch=50) == pytest.approx(0.4)


def test_goyal_golden_table():
    s = Schedule(lr_per_ref=0.1, epochs=90, warmup_epochs=5, warmup_start_factor=None,
                 decay="step", milestones=(30, 60, 80))
    t = BatchTable.constant(8192)
    golden = [(0.0, 0.1), (2.5, 1.65), (5.0, 3.2), (29.999, 3.2), (30.0, 0.32), (59.9, 0.32),
              (60.0, 0.032), (80.0, 0.0032), (89.99, 0.0032)]
    for epoch, lr in golden:
        assert lr_at(epoch, s, t) == pytest.approx(lr), epoch
    # at the reference batch the warmup start factor is 1: no warmup effect
    assert lr_at(0.0, s, BatchTable.constant(256)) == pytest.approx(0.1)


def test_poly_and_cosine_end_points():
    t = BatchTable.constant(512)  # peak 0.2
    poly = Schedule(lr_per_ref=0.1, epochs=10, warmup_epochs=2, decay="poly", power=2.0)
    golden = [(0.0, 0.0), (1.0, 0.1), (2.0, 0.2), (6.0, 0.2 * 0.25), (10.0, 0.0)]
    for epoch, lr in golden:
        assert lr_at(epoch, poly, t) == pytest.approx(lr, abs=1e-12), epoch
    cos = Schedule(lr_per_ref=0.1, epochs=10, warmup_epochs=0, decay="cosine", final_factor=0.1)
    assert lr_at(0.0, cos, t) == pytest.approx(0.2)
    assert lr_at(5.0, cos, t) == pytest.approx(0.2 * (0.1 + 0.9 * 0.5))
    assert lr_at(10.0, cos, t) == pytest.approx(0.02)
    assert lr_at(12.0, cos, t) == pytest.approx(0.02)  # past the end: stays at the floor
    assert decay_factor(3.0, Schedule(epochs=10, decay="none")) == 1.0


def test_batch_table_changes_batch_and_lr():
    t = BatchTable(((0, 1024), (2, 2048), (5, 4096)))
    assert [batch_at(e, t) for e in (0, 1.9, 2, 4.99, 5, 100)] == [1024, 1024, 2048, 2048, 4096, 4096]
    s = Schedule(lr_per_ref=0.1, epochs=10)
    assert [round(lr_at(e, s, t), 6) for e in (1.5, 2.0, 5.0)] == [0.4, 0.8, 1.6]
    assert lr_table(s, t, [0.0, 5.0]) == [(0.0, 1024, pytest.approx(0.4)), (5.0, 4096, pytest.approx(1.6))]


def test_epoch_at_step_follows_the_batch_table():
    t = BatchTable(((0, 1000), (2, 2000)))
    # 10,000 samples: 10 steps per epoch at 1000, 5 at 2000
    assert steps_per_epoch(10_000, 1000) == 10 and steps_per_epoch(10_000, 3000) == 4
    assert steps_per_epoch(10_000, 3000, drop_last=True) == 3
    golden = [(0, 0.0), (5, 0.5), (10, 1.0), (20, 2.0), (22, 2.4), (25, 3.0), (30, 4.0)]
    for step, epoch in golden:
        assert epoch_at_step(step, t, 10_000) == pytest.approx(epoch), step
    s = Schedule(lr_per_ref=0.256, ref_batch=256, epochs=10, warmup_epochs=1)
    assert lr_at_step(5, s, t, 10_000) == pytest.approx(0.5)  # half-way through warmup at 1000
    assert lr_at_step(20, s, t, 10_000) == pytest.approx(2.0)  # batch doubled, LR doubled


def test_lambda_lr_matches_pure_function():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=123.0, momentum=0.9)
    s = Schedule(lr_per_ref=0.1, epochs=4, warmup_epochs=1, decay="cosine")
    t = BatchTable(((0, 256), (2, 512)))
    sched = lambda_lr(opt, s, t, num_samples=1024)
    for step in range(14):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at_step(step, s, t, 1024)), step
        opt.step()
        sched.step()


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr_per_ref=-0.1), "lr_per_ref"),
    (dict(epochs=0), "epochs"),
    (dict(epochs=10, warmup_epochs=11), "warmup_epochs"),
    (dict(warmup_start_factor=1.5), "warmup_start_factor"),
    (dict(decay="linear"), "decay"),
    (dict(decay="step"), "milestones"),
    (dict(epochs=10, decay="step", milestones=(5, 3)), "milestones"),
    (dict(epochs=10, decay="step", milestones=(5, 30)), "milestones"),
    (dict(gamma=0.0), "gamma"),
    (dict(power=0.0), "power"),
    (dict(final_factor=1.0), "final_factor"),
])
def test_bad_schedule_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Schedule(**kwargs)


@pytest.mark.parametrize("rows, match", [
    ((), "empty"),
    (((1, 256),), "epoch 0"),
    (((0, 256), (3, 512), (3, 1024)), "strictly increase"),
    (((0, 256), (3, 512), (2, 1024)), "strictly increase"),
    (((0, 512), (3, 256)), "must not decrease"),
    (((0, 0),), ">= 1"),
    (((0, 256.0),), "batch at epoch 0 must be an integer"),
])
def test_bad_batch_table(rows, match):
    with pytest.raises(ValueError, match=match):
        BatchTable(rows)


def test_bad_scalars():
    with pytest.raises(ValueError, match="global_batch"):
        scaled_lr(0.1, 0)
    with pytest.raises(ValueError, match="lr_per_ref"):
        scaled_lr(-1.0, 256)
    with pytest.raises(ValueError, match="step"):
        epoch_at_step(-1, BatchTable.constant(8), 100)
    with pytest.raises(ValueError, match="drop_last"):
        steps_per_epoch(100, 200, drop_last=True)
    assert math.isclose(lr_at(0.0, Schedule(), BatchTable.constant(256)), 0.1)


def test_scaled_lr_saturates_at_lr_max():
    # McCandlish et al.: lr_max / (1 + B_noise / B), B_noise = lr_max * ref / lr_per_ref = 8192 here
    for batch in (128, 4096, 8192, 32768, 10 ** 7):
        assert scaled_lr(0.1, batch, 256, lr_max=3.2) == pytest.approx(3.2 / (1 + 8192 / batch))
    assert scaled_lr(0.1, 64, 256, lr_max=3.2) == pytest.approx(0.025, rel=0.01)  # ~linear far below
    assert scaled_lr(0.1, 8192, 256, lr_max=3.2) == pytest.approx(1.6)           # half of each at B_noise
    assert scaled_lr(0.1, 8192, 256) == pytest.approx(3.2)                       # none: linear
    s = Schedule(lr_per_ref=0.1, epochs=10, lr_max=3.2)
    assert lr_at(5.0, s, BatchTable.constant(16384)) == pytest.approx(3.2 * 2 / 3)
    with pytest.raises(ValueError, match="lr_max must be None or a finite number > 0, got 0"):
        Schedule(lr_max=0.0)
