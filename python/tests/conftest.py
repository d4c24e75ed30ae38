import os
import threading
import time

import pytest

#: Test files that need torch (no GPU): with ``SYMMPOOL_REQUIRE_TORCH=1`` (CI sets it,
#: ``python/ci.sh``) any skip in them, of the whole module (torch or its FSDP2 not
#: installed) or of a test, is a failure, so that CI cannot pass without running them.
TORCH_TESTS = ("test_fsdp_cpu.py", "test_torch_cpu.py")


def _torch_required(path):
    return os.environ.get("SYMMPOOL_REQUIRE_TORCH") == "1" and os.path.basename(str(path)) in TORCH_TESTS


def _fail_skip(report, what):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{what} was skipped ({reason}), but SYMMPOOL_REQUIRE_TORCH=1 requires it to run"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _torch_required(getattr(collector, "path", "")):
        _fail_skip(report, f"module {os.path.basename(str(collector.path))}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _torch_required(item.path):
        _fail_skip(report, item.nodeid)


class FakeStore:
    """An in-memory store with the methods of ``torch.distributed.Store`` that symmpool
    uses (set, get, add, wait, check, delete_key), safe across threads."""

    def __init__(self):
        self.data = {}
        self.cv = threading.Condition()
        self.calls = 0

    def set(self, key, value):
        with self.cv:
            self.calls += 1
            self.data[key] = bytes(value) if not isinstance(value, str) else value.encode()
            self.cv.notify_all()

    def get(self, key):
        with self.cv:
            self.calls += 1
            return self.data[key]

    def add(self, key, delta):
        with self.cv:
            self.calls += 1
            value = int(self.data.get(key, b"0")) + delta
            self.data[key] = str(value).encode()
            self.cv.notify_all()
            return value

    def wait(self, keys, timeout):
        deadline = time.monotonic() + timeout.total_seconds()
        with self.cv:
            self.calls += 1
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"wait timeout for {keys}")
                self.cv.wait(left)

    def check(self, keys):
        with self.cv:
            return all(k in self.data for k in keys)

    def delete_key(self, key):
        with self.cv:
            return self.data.pop(key, None) is not None


def run_ranks(world, fn):
    """Run fn(rank) on `world` threads; return the results in rank order, re-raising
    the first exception."""
    results = [None] * world
    errors = [None] * world

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for e in errors:
        if e is not None:
            raise e
    return results


class ClientStore:
    """A client of a shared :class:`FakeStore` that runs one operation at a time, as a
    client of c10d's ``TCPStore`` does (its socket serves one request and its answer
    at a time: a blocking ``wait`` holds it until the keys exist or the wait times
    out), with ``clone()`` making another client of the same data, as c10d's does.
    ``contended`` counts operations that had to wait for another one on the same
    client."""

    def __init__(self, data=None, counter=None):
        self.store = data if data is not None else FakeStore()
        self.lock = threading.Lock()
        self.counter = counter if counter is not None else {"contended": 0, "clones": 0}

    @property
    def contended(self):
        return self.counter["contended"]

    def clone(self):
        self.counter["clones"] += 1
        return ClientStore(self.store, self.counter)

    def _one(self, fn, *args):
        if not self.lock.acquire(blocking=False):
            self.counter["contended"] += 1
            self.lock.acquire()
        try:
            return fn(*args)
        finally:
            self.lock.release()

    def set(self, key, value):
        return self._one(self.store.set, key, value)

    def get(self, key):
        return self._one(self.store.get, key)

    def add(self, key, delta):
        return self._one(self.store.add, key, delta)

    def wait(self, keys, timeout):
        return self._one(self.store.wait, keys, timeout)

    def check(self, keys):
        return self._one(self.store.check, keys)

    def delete_key(self, key):
        return self._one(self.store.delete_key, key)
