"""Controller-side fleet operations: ops (status, logs, restart, bench), doctor, the cluster link
checks, tune, and the benchmark report with its charts."""
