import random

import pytest
import torch


@pytest.fixture(autouse=True)
def seed_everything():
    """Every test starts from the same random state, so a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)
    yield
