import random
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from twobp_autograd.queue import current_queue, queues_with_work
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
def no_work_left_queued(request: pytest.FixtureRequest):
    """Every test ends with no queue holding work: a case that forgot to flush (or lost work)
    fails here. A test that leaves work on purpose discards it itself."""
    current_queue().clear()
    yield
    left = [queue.pending() for queue in queues_with_work()]
    for queue in queues_with_work():
        queue.clear()
    call = getattr(request.node, "call_report", None)
    if left and call is not None and call.passed:  # a failed test has its own story to tell
        pytest.fail(f"weight-gradient work left queued after the test: {left}", pytrace=False)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.call_report = report
    return report


@pytest.fixture(autouse=True)
def scoped_registrations():
    """A type a test registers is forgotten when it ends."""
    with rules_restored_after():
        yield


@pytest.fixture
def one_rank_group(tmp_path) -> Iterator[None]:
    """A gloo process group of this process alone, for what needs one to be built."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
