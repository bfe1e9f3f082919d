"""Test-only, for a child process whose PYTHONPATH starts with this folder (Python imports
`sitecustomize` at start-up): the GCS clients' retry budgets shortened for the whole process, as
gcs_emulator.shorten_client_retries() does in the tests' own process, so an outage fails the
child's next save in seconds instead of gcsfs's ~35 s of backoff. Nothing else changes."""

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.extend([TESTS, os.path.dirname(TESTS)])  # gcs_emulator, helpers; the repository they import from

from gcs_emulator import shorten_client_retries  # noqa: E402

SHORTENED = shorten_client_retries()  # kept: a collected context manager would restore the budgets
SHORTENED.__enter__()  # for the life of the process: never exited
