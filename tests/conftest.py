import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from models import tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)
