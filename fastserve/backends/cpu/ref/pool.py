"""Twin of fastserve.backends.cpu._pool: a Pool runs its loops on the calling thread (the threads change no
number, as in C, so a one-thread twin is the whole behaviour)."""
MAX_THREADS = 64


class Pool:
    def __init__(self, threads: int = 1, spin_us: float = 100.0):
        if threads < 1 or threads > MAX_THREADS:
            raise ValueError(f"threads must be in 1..{MAX_THREADS}, got {threads}")
        self.threads, self.spin_us = threads, spin_us

    def prefetch_then(self, data):
        """Nothing to prefetch on one thread; data is checked as the C pool checks it (a buffer, or None)."""
        if data is not None:
            memoryview(data).cast("B")

    def close(self):
        pass

    def __repr__(self):
        return f"Pool(threads={self.threads})"
