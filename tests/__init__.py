"""The test suite: tests/static (the repository's files), tests/unit (the fast tier),
tests/e2e (the slow tier), and tests/harness (what they share: running the trainer,
simulated nodes, hosts, pods and a SLURM cluster). See tests/README.md."""
