"""Session hooks shared by the test modules."""

import os

from triton_interpreter import start_interpreted_runs

INTERPRETER_TEST_SUFFIX = "under_the_triton_interpreter"  # the tests that re-run their module interpreted


def pytest_collection_finish(session):
    """Start the Triton-interpreter re-runs of the selected tests in the background, in test order
    (:mod:`triton_interpreter`): they are single-threaded, and the main run would otherwise wait on each."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # a child itself
        return
    modules = [item.path for item in session.items if item.name.endswith(INTERPRETER_TEST_SUFFIX)]
    start_interpreted_runs(dict.fromkeys(modules))
