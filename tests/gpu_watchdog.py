"""A time limit for one test whose work may never return: a GPU kernel that hangs cannot be interrupted from Python,
so past the limit the watchdog names the test, prints every thread's stack and ends the process. Under xdist the
run then reports a crashed worker running that test, starts another and goes on, instead of holding the whole run
until the command's own limit."""
import contextlib
import faulthandler
import os
import sys
import threading

EXIT_CODE = 70  # os.EX_SOFTWARE: an internal failure, not a test's own exit status
ENV = "DASH_ATTN_GPU_TEST_TIMEOUT"
DEFAULT_SECONDS = 300.0


def limit_seconds(environ=os.environ):
    """The per-test limit from DASH_ATTN_GPU_TEST_TIMEOUT (seconds; 0 turns the watchdog off)."""
    text = environ.get(ENV, "")
    try:
        return float(text) if text else DEFAULT_SECONDS
    except ValueError:
        raise ValueError(f"{ENV} must be a number of seconds, got {text!r}") from None


def _expire(label, seconds):
    sys.stderr.write(f"\nwatchdog: {label} still running after {seconds:g} s ({ENV}); every thread's stack:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_CODE)


@contextlib.contextmanager
def watchdog(label, seconds):
    """Runs the body with a limit of `seconds` (<= 0: none); past it the process ends with EXIT_CODE."""
    if seconds <= 0:
        yield
        return
    timer = threading.Timer(seconds, _expire, args=(label, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
