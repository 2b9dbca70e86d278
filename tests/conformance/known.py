"""Cases of torch's backend suite whose outcome on groupcomm differs from gloo's
for a reason outside this project, each with that reason (read by compare.py
and tests/test_torch_suite.py)."""

KNOWN_DIFFERENCES = {
}
