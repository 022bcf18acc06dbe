"""`flashsgd train`'s checks before the start line (flashsgd.train.preflight): what the config says
about the data before they are made is what the data are, so a run the preflight passes is the run
the trainer plans (issue 49 item 7)."""

from __future__ import annotations

import pytest
import torch

from flashsgd.train import config as C
from flashsgd.train.plan import build_plan
from flashsgd.train.preflight import expected_data
from flashsgd.train.rank import load_data


@pytest.mark.parametrize("cli", [
    {"num_samples": "2000"},
    {"num_samples": "1230", "data_seed": "7"},  # 0.8 * 1230 = 984: the split's rounding
    {"dataset": "synthetic", "image_shape": "cifar", "num_samples": "300", "model": "resnet20"},
])
def test_the_expected_data_are_the_data(tmp_path, cli):
    cfg = C.resolve(cli={**cli, "data_dir": str(tmp_path), "global_batch": "128", "epochs": "2"})
    stand_in, num_train = expected_data(cfg)
    data = load_data(cfg)
    assert num_train == len(data.train)
    assert stand_in.num_classes == data.num_classes
    two = torch.arange(2)
    x, _ = data.train.batch(two, train=False)
    y, _ = stand_in.train.batch(two, train=False)
    assert tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype
    # the plan from the expected count is the trainer's plan from the data
    assert build_plan(cfg, 2, num_train, True, "gloo").to_dict() == \
        build_plan(cfg, 2, len(data.train), True, "gloo").to_dict()


def test_an_image_folder_is_left_to_its_scan():
    assert expected_data(C.resolve(cli={"dataset": "imagefolder", "data_dir": "/nonexistent"})) is None
