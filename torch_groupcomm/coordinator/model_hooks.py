"""The calls vLLM's model runners make on a coordinator around a model:
graph capture, communication buffers, expert-parallel dispatch and combine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GraphCaptureContext:
    """What ``graph_capture`` yields: the stream work is captured on (None on CPU)."""

    stream: Any | None


class ModelHooks:
    """A model's hooks into a ``GroupCoordinator``'s device communicator (a
    base of it)."""

    @contextmanager
    def graph_capture(self, graph_capture_context: GraphCaptureContext | None = None) -> Iterator[GraphCaptureContext]:
        """Scope for capturing a graph: on CUDA the work runs on a side stream
        (the given context's, or a new one) that first waits for the current
        stream; on the CPU there is nothing to capture on (stream None)."""
        if graph_capture_context is None:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            graph_capture_context = GraphCaptureContext(stream)
        stream = graph_capture_context.stream
        if stream is None:
            yield graph_capture_context
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield graph_capture_context

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Let the device communicator register buffers for ``model``."""
        if self.device_communicator is not None:
            self.device_communicator.prepare_communication_buffer_for_model(model)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ):
        """Expert-parallel dispatch through the device communicator (identity
        in the base communicator)."""
        if self.device_communicator is None:
            return hidden_states, router_logits
        return self.device_communicator.dispatch(hidden_states, router_logits)

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False) -> torch.Tensor:
        """Expert-parallel combine (identity in the base communicator)."""
        if self.device_communicator is None:
            return hidden_states
        return self.device_communicator.combine(hidden_states)
