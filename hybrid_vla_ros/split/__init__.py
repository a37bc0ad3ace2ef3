"""Choosing and moving the split layer K: the memory / latency plan, the profiler, live re-split."""
