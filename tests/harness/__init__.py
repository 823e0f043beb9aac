"""What the tests share: :mod:`tests.harness.runs` (configs, environments, real runs of
the trainer, time limits), :mod:`tests.harness.procs` (the process tree from /proc),
and the simulations: :mod:`~tests.harness.multinode` (nodes in PID namespaces),
:mod:`~tests.harness.netns` (hosts in network namespaces), :mod:`~tests.harness.kubesim`
(the k8s/ manifests' pods), :mod:`~tests.harness.slurmcluster` (a real SLURM cluster) and
:mod:`~tests.harness.wandbfile` (W&B's offline run files). Importing this package
imports none of them (nor torch)."""
