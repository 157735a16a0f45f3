import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("FXDEBUG_TEST_THREADS", "1")))

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; none is present")
    skip_slow = pytest.mark.skip(reason="slow; run with FXDEBUG_SLOW=1")
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not os.environ.get("FXDEBUG_SLOW"):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
