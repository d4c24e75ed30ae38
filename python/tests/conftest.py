import threading
import time


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
