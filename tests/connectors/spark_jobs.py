"""A Spark job's command run in the test process on the tests' shared SparkSession (the ``spark`` fixture of
tests/connectors/conftest.py): the job module's own ``main`` -- the command's code -- without a JVM start per run."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Sequence
from typing import Any


def run_in_session(main: Callable[..., int], argv: Sequence[str], spark: Any) -> dict[str, Any]:
    """``main(argv, spark=spark)`` must exit 0; returns the JSON summary it prints last."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv), spark=spark)
    assert rc == 0, out.getvalue()[-3000:]
    return dict(json.loads(out.getvalue().strip().splitlines()[-1]))
