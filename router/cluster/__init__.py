"""The local cluster: processes, the workload that drives it, and its report."""
