"""The benchmarks, each a module run from the repository root: ``python -m bench.NAME``
(``make bench`` runs ddp_overhead, startup, throughput and defaults). They import the
project and the test harness (tests/harness) as packages."""
