"""Tests of the TorchTitan launcher and assets: run by `make test-torchtitan` (REQUIRE_TORCHTITAN=1)
only, and not even collected by `make test`, whose count and time stay as they were."""

import os

collect_ignore_glob = [] if os.environ.get("REQUIRE_TORCHTITAN") == "1" else ["test_*.py"]
