"""The test suite's scheduling (tests/conftest.py): under ``make test``'s pytest-xdist workers, the
tests that share a module-scoped fixture (an end-to-end run several tests look at) are one unit of
work, so that the run is made once, on one worker."""

import conftest
from helpers import TESTS

MODULE = '''
import pytest

@pytest.fixture(scope="module")
def run_once(tmp_path_factory):
    return 1

@pytest.fixture
def its_rows(run_once):
    return [run_once]

@pytest.fixture(scope="module", autouse=True)
def table():
    yield

@pytest.fixture
def plain(tmp_path):
    return tmp_path

def test_direct(run_once):
    pass

def test_through_a_fixture(its_rows, plain):
    pass

def test_alone(plain):
    pass

def test_nothing():
    pass
'''


def test_tests_sharing_a_module_fixture_are_one_unit(tmp_path):
    path = tmp_path / "test_mod.py"
    path.write_text(MODULE)
    assert conftest.shared_fixture_users(str(path)) == {"test_direct", "test_through_a_fixture"}
    e2e = conftest.shared_fixture_users(str(TESTS / "test_e2e.py"))
    assert "test_a_resumed_run_trains_what_the_uninterrupted_one_trains" in e2e
    assert "test_ctrl_c_stops_every_actor_and_keeps_outputs" not in e2e
