"""``python -m kvconnect.harness.worker``: :func:`.process.main`, then exit without teardown."""
from kvconnect.harness.worker.process import main
from kvconnect.interrupts import exit_now

if __name__ == "__main__":  # not on import (tests/test_error_root.py imports every module)
    exit_now(main())
