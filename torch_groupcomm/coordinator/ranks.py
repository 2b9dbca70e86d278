"""A coordinator's place in its group, as vLLM's ``GroupCoordinator`` names
it, and the checks of rank and dim arguments its calls share."""

from __future__ import annotations

import torch

from ..checks import check_peer, check_rank


class RankOrder:
    """Ranks of a ``GroupCoordinator``'s group (a base of it): global ranks in
    group order, neighbours wrapping around."""

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """Whether this process is the group's first member."""
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        """Whether this process is the group's last member."""
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _check_rank(self, what: str, rank: int) -> int:
        return check_rank(f"groupcomm: {what}", rank, self.world_size, f"group {self.unique_name!r}")

    def _check_peer(self, what: str, rank: int) -> int:
        return check_peer(
            f"groupcomm: {what}", rank, self.rank_in_group, self.world_size, f"group {self.unique_name!r}"
        )

    @staticmethod
    def _check_dim(tensor: torch.Tensor, dim: int) -> int:
        ndim = max(tensor.dim(), 1)
        if not -ndim <= dim < ndim:
            raise ValueError(f"groupcomm: dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
        return dim % ndim
