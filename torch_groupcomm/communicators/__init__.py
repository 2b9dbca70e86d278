"""Device communicators: how bytes move among a group's ranks on one device type."""

from .base import DeviceCommunicatorBase
from .gloo import GlooCommunicator
from .hierarchical import HierarchicalCommunicator
from .shm import ShmCommunicator

__all__ = ["DeviceCommunicatorBase", "GlooCommunicator", "HierarchicalCommunicator", "ShmCommunicator"]
