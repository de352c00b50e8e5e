"""What the Python integration tests (compose_test.py, nat_test.py) share:
run(main) exits with main()'s status, and turns a failed check, a runtime
error or a timeout into one FAIL line and exit status 1."""
import subprocess
import sys


def run(main):
    try:
        sys.exit(main())
    except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
