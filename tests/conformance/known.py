"""Cases of torch's backend suite whose outcome on groupcomm differs from gloo's
for a reason outside this project, each with that reason (read by compare.py
and tests/test_torch_suite.py)."""

KNOWN_DIFFERENCES = {
    "test_get_backend": (
        "asserts dist.get_backend() equals the suite's BACKEND, which must read 'gloo' for its gloo "
        "cases to run at all; dist.get_backend() correctly says 'groupcomm'"
    ),
    "test_ddp_logging_data_cpu": (
        "asserts DDP's logged backend_name equals dist.get_backend(); DDP logs the C++ "
        "ProcessGroup::getBackendName(), which torch fixes to 'custom' for every third-party "
        "backend (BackendType::CUSTOM), so it reads 'custom' against 'groupcomm'"
    ),
}
