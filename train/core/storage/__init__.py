"""Storage, one torch-free capability: where bytes live and how object storage is reached.

- the seam the checkpoint store writes through (:mod:`.seam`: :class:`~.seam.Storage`),
  a folder on a file system (:mod:`.local`) and a key prefix of an S3-compatible bucket
  (:mod:`.bucket`);
- the S3 client that checkpoints, data and the run's lease share, what its errors say,
  and the launcher's checks of ``checkpoint.remote`` before any worker starts
  (:mod:`.s3`); the ``s3://`` URLs (:mod:`.urls`);
- credentials: refused in the config, hidden in everything printed (:mod:`.credentials`);
- the run's lease in the store, one job per remote run (:mod:`.lease`).

It lives in ``train.core`` because the launcher, which imports nothing else of train,
checks the bucket and takes the lease before workers start. Nothing here imports boto3
at module level (an optional extra); torch and numpy never.
"""
