import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from train_fixtures import staged_dir, tiny_cfg  # noqa: E402


@pytest.fixture(scope="session")
def staged(tmp_path_factory) -> Path:
    """One tiny staged dataset for the whole session (read-only)."""
    return staged_dir(tmp_path_factory.mktemp("staged"), tiny_cfg())
