import random

import pytest
import torch

from twobp_autograd.queue import current_queue
from twobp_autograd.registry import rules_restored_after


# One thread: on a loaded 2-core machine two OpenMP threads per process spin against each
# other and run many times slower; the tests' figures do not depend on it.
torch.set_num_threads(1)


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


@pytest.fixture(autouse=True)
def scoped_registrations():
    """A type a test registers is forgotten when it ends."""
    with rules_restored_after():
        yield
