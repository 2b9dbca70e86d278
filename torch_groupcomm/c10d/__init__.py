"""The c10d layer: the only code that knows torch.distributed's backend API.

- ``registration``: makes ``groupcomm`` a c10d backend; builds each group's
  coordinator and bridge.
- ``ops``: the op contract, the ops the C++ bridge forwards (one row each).
- ``frontend``: what the bridge calls: checks c10d's arguments, stages the
  tensors and runs or queues the op on the group's communicator.
- ``debug_check``: the frontend under ``GROUPCOMM_DEBUG=1``, which compares
  every collective across ranks before running it.
"""
