"""Process plumbing shared by every mlxd process: config flags, lifecycle, logging."""
