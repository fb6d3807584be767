"""Data-parallel training helpers over any gpucoll ``Communicator``.

* :class:`Bucketer` - fused, overlapped gradient averaging (bucketing, compression,
  accumulation with ``no_sync``, loss-scale unscaling with a non-finite flag);
  :func:`broadcast_parameters` - copy rank 0's parameters everywhere.
* :class:`DistributedSampler` - disjoint per-rank shards of a dataset, reshuffled per epoch.
* :func:`all_reduce_metrics` - sum counters across ranks in one all-reduce.
* :func:`sync_batch_stats`, :class:`SyncBatchNorm` - batch norm over the global batch.

Importing this package never imports CuPy.
"""

from .bucketer import Bucketer, broadcast_parameters, plan_buckets
from .metrics import all_reduce_metrics
from .sampler import DistributedSampler
from .sync_bn import SyncBatchNorm, sync_batch_stats

__all__ = ["Bucketer", "broadcast_parameters", "plan_buckets", "DistributedSampler",
           "all_reduce_metrics", "sync_batch_stats", "SyncBatchNorm"]
