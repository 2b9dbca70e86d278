"""Device communicators: how bytes move among a group's ranks on one device type."""

from .base import DeviceCommunicatorBase
from .gloo import GlooCommunicator

__all__ = ["DeviceCommunicatorBase", "GlooCommunicator"]
