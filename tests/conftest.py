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
