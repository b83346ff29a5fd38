import random

import pytest
import torch

from twobp_autograd.queue import current_queue


@pytest.fixture(autouse=True)
def seed_everything():
    """Every test starts from the same random state, so a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def empty_default_queue():
    """No test sees weight-gradient work left queued by another."""
    current_queue().clear()
    yield
    current_queue().clear()
