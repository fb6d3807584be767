"""Data-parallel training helpers over any gpucoll ``Communicator``.

* :class:`Bucketer` - fused, overlapped gradient averaging (bucketing, compression,
  accumulation with ``no_sync``, loss-scale unscaling with a non-finite flag);
  :func:`broadcast_parameters` - copy rank 0's parameters everywhere.
* :class:`ShardedOptimizer` - ZeRO stage 1: reduce-scatter gradients, update only this rank's
  shard (optimizer state is 1 / world_size of DDP's), all-gather the parameters.
* :class:`FullyShardedParameters` - ZeRO stage 3 / FSDP: parameters, gradients and optimizer
  state all sharded; a layer is all-gathered only while it computes (prefetch included).
* Hybrid sharding (HSDP) for both: ``replicate_comm=`` shards inside a group and replicates
  across groups; only each slice's gradient crosses groups, as one all-reduce per step.
* Checkpoints of both that load at any world size: ``state_dict()`` / ``load_state_dict()``
  (whole arrays, gathered) and ``save_checkpoint()`` / ``load_checkpoint()`` (each rank writes
  and reads only its slices); :func:`checkpoint_exists`.
* :func:`clip_grad_norm` - clip to a global gradient norm, replicated or sharded (all-reduced);
  ``step(max_norm=...)`` of both sharded classes does it between averaging and the update.
* :class:`PowerSGD` - low-rank gradient compression with error feedback (torch's
  ``powerSGD_hook``): two small all-reduces instead of one of every element; after backward,
  or per bucket during it as a Bucketer's :class:`CommHook` (``Bucketer(..., comm_hook=)``).
* :class:`LocalSGD`, :class:`DiLoCo` - communicate every H steps: average the parameters
  (local SGD), or apply the averaged pseudo-gradient with an outer Nesterov SGD (DiLoCo).
* :class:`SGD`, :class:`Adam` - element-wise optimizers written with the array module.
* :class:`DynamicLossScaler` - mixed-precision loss scaling: skip on overflow on every rank
  together, back off, grow after clean steps.
* :class:`DistributedSampler` - disjoint per-rank shards of a dataset, reshuffled per epoch.
* :func:`all_reduce_metrics` - sum counters across ranks in one all-reduce.
* :func:`sync_batch_stats`, :class:`SyncBatchNorm` - batch norm over the global batch.

Importing this package never imports CuPy.
"""

from .bucketer import Bucketer, broadcast_parameters, plan_buckets
from .checkpoint import CheckpointError
from .clipping import clip_grad_norm, global_grad_norm
from .comm_hook import CommHook
from .powersgd import PowerSGD
from .checkpoint_files import checkpoint_exists
from .local_sgd import DiLoCo, LocalSGD
from .loss_scaler import DynamicLossScaler
from .metrics import all_reduce_metrics
from .optim import SGD, Adam, make_optimizer
from .sampler import DistributedSampler
from .fsdp import FullyShardedParameters
from .sharded import ShardedOptimizer
from .sync_bn import SyncBatchNorm, sync_batch_stats

__all__ = ["Bucketer", "broadcast_parameters", "plan_buckets", "ShardedOptimizer",
           "FullyShardedParameters", "CheckpointError", "checkpoint_exists",
           "clip_grad_norm", "global_grad_norm", "PowerSGD", "CommHook", "LocalSGD", "DiLoCo",
           "SGD", "Adam", "make_optimizer", "DynamicLossScaler", "DistributedSampler",
           "all_reduce_metrics", "sync_batch_stats", "SyncBatchNorm"]
