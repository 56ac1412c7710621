import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(2)


@pytest.fixture
def samples():
    return ROOT / "samples"


@pytest.fixture
def models():
    return ROOT / "tests" / "models"


# `make test-fast` (FXSHARD_TEST_FAST=1) runs the tests that start no process group; a test that does start
# one without its `distributed` / `e2e` marker fails there, naming itself, instead of slowing the edit loop.
if os.environ.get("FXSHARD_TEST_FAST") == "1":
    import torch.distributed as dist

    def _refuse(*args, **kwargs):
        raise RuntimeError("this test starts a process group: mark it @pytest.mark.distributed (or e2e)")

    dist.init_process_group = _refuse
    import fxshard.testing

    fxshard.testing.spawn = _refuse
    import harness

    import fxshard.train.local

    harness.spawn = fxshard.train.local.launch_local = _refuse
