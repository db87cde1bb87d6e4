import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
