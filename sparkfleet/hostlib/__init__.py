"""What is copied to the serving hosts and runs there under the service venv's Python: the bench
clients, their workloads and the one /metrics parser. Standard library, httpx and prometheus_client
only (tests/unit/test_bench_portable.py): nothing here may import the rest of sparkfleet."""
