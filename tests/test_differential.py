"""Short CI version of the seeded randomized differential test (tests/differential.py):
a few hundred random collectives per configuration, each run on groupcomm and on
gloo (or checked against torch math) with the same inputs, on real ranks.

The long version: ``python tests/differential.py --world 4 --calls 3000 --seed 123``."""

from __future__ import annotations

import differential as D
import pytest
import torch

# (id, world, calls, seed, env): the shared-memory path at world 3 and 4, the
# gloo communicator, small shared-memory chunks (every larger message is
# chunked), two simulated hosts (hierarchical communicator, its rails with
# the ranks in host order and interleaved), three hosts of one rank (gloo),
# and the buffers the peers read in place.
CONFIGS = [
    ("shm-3", 3, 400, 1, {}),
    ("shm-4", 4, 400, 2, {}),
    ("gloo-3", 3, 300, 3, {"GROUPCOMM_CPU_COMMUNICATOR": "gloo"}),
    ("chunked-3", 3, 800, 4, {"GROUPCOMM_SHM_CHUNK_BYTES": "4096", "GROUPCOMM_SPIN_US": "0"}),
    ("hosts-aabb", 4, 300, 5, {"GROUPCOMM_HOST_ID": ["a", "a", "b", "b"]}),
    ("hosts-abab", 4, 300, 6, {"GROUPCOMM_HOST_ID": ["a", "b", "a", "b"]}),
    ("hosts-abc", 3, 300, 7, {"GROUPCOMM_HOST_ID": ["a", "b", "c"]}),
    # longer: a dozen large all-reduces, all-gathers and reduce-scatters with
    # every rank's buffer, or some ranks', in shared memory (read in place)
    ("shared-4", 4, 1200, 14, {}),
]


@pytest.mark.parametrize("world,calls,seed,env", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_differential(world: int, calls: int, seed: int, env: dict[str, object]) -> None:
    summary = D.run(world, calls, seed, env=env)
    print(summary.format())
    assert summary.passed, summary.format()
    missing = [label for label in D.LABELS if not summary.per_label.get(label) or not summary.executed.get(label)]
    assert not missing, f"op kinds not exercised: {missing}\n{summary.format()}"
    assert summary.refs.get("gloo") and summary.refs.get("torch math"), summary.refs
    assert summary.compared > calls
    assert summary.shared_buffers > 0 or not summary.shares, summary.format()
    assert summary.coalesced > 0, summary.format()  # torch's coalesced forms (_coalescing_manager blocks)


def test_sequence_is_deterministic_and_data_per_rank() -> None:
    """Ranks agree on the calls; the data depends on (seed, call, rank, slot) only."""
    specs = D.group_specs(4)
    a, b = D.generate_calls(7, 4, 300), D.generate_calls(7, 4, 300)
    assert [c.describe(specs[c.group]) for c in a] == [c.describe(specs[c.group]) for c in b]
    assert [c.describe(specs[c.group]) for c in D.generate_calls(8, 4, 50)] != [
        c.describe(specs[c.group]) for c in a[:50]
    ]
    call = next(c for c in a if c.kind == "all_reduce" and c.dtype == torch.float32 and c.shape and c.shape[0] > 4)
    x0 = D.make_data(7, call, 0, 0, call.shape)
    assert torch.equal(x0, D.make_data(7, call, 0, 0, call.shape))
    assert not torch.equal(x0, D.make_data(7, call, 1, 0, call.shape))


def test_compare_catches_differences() -> None:
    x = torch.tensor([1.0, float("nan"), -0.0])
    assert D.compare(x, x.clone(), "bits", None) is None
    assert D.compare(x, torch.tensor([1.0, float("nan"), 0.0]), "bits", None) is not None  # -0.0 vs 0.0
    y = torch.tensor([1.0, 2.0])
    assert D.compare(y + 1e-7, y, "value", (1e-6, 0.0)) is None
    err = D.compare(y + 1e-3, y, "value", (1e-6, 0.0))
    assert err is not None and "max |diff|" in err
    assert D.compare(torch.tensor([1.0, float("nan")]), y, "value", (1.0, 1.0)) is not None
    assert (
        D.compare(torch.tensor([3], dtype=torch.int8), torch.tensor([4], dtype=torch.int8), "value", None) is not None
    )
    assert D.compare(torch.ones(2), torch.ones(3), "value", None) is not None
