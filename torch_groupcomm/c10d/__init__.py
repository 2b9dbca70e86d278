"""The c10d layer: the only code that knows torch.distributed's backend API.

- ``registration``: makes ``groupcomm`` a c10d backend; builds each group's
  coordinator and bridge.
- ``ops``: the op contract, the ops the C++ bridge forwards (one row each).
- ``frontend``: what the bridge calls: checks c10d's arguments
  (``arguments``), then hands a task that stages the tensors and runs the
  communicator's primitive to the ``submission`` (run now, queued, or on
  the device's stream).
- ``debug_check``: the frontend under ``GROUPCOMM_DEBUG=1``, which compares
  every collective across ranks before running it.
"""
