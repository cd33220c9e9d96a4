"""Real processes for tests and benchmarks (`procs`): redis-server, gateway, workers and
supervisord on free loopback ports, each stopped by its own pid. Not a test module: the
tests (tests/conftest.py) and the benchmarks (bench/common.py) both import it."""
