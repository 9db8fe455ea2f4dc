import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RouterThread


@pytest.fixture(scope="module")
def router():
    """One router + stub per test module (stub behaviour reset to defaults after each test)."""
    r = RouterThread()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def _reset_stub(request):
    yield
    if "router" in request.fixturenames:
        r = request.getfixturevalue("router")
        r.set_stub(first_token_delay_s=0.0, token_delay_s=0.0, fail_with=None, fail_after=0,
                   overloaded_retry_after=None, eos_prob=0.0, tokens_per_chunk=1, script=())
