import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the thread hand-offs
# cost more than the maths.
torch.set_num_threads(1)

from models import tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)
